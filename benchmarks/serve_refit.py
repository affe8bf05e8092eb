"""A live vLLM server under a fixed streaming load, refitted every few seconds by a 2-rank
FSDP2 trainer over vLLM's own HTTP weight-sync protocol (the reshard trainer engine), in
one run, side by side:

  (a) no refit;
  (b) stop-the-world refits (``/pause``, start, a blocking ``update_weights`` while the
      trainer sends, finish, ``/resume``: as RL frameworks refit a server today);
  (c) overlapped refits (the engine's ranks receive in the background while it
      generates; the engine stops only for the swap).

Per refit: the engine's pause (rank 0's figure: the whole round for (b), the finish call
that swaps for (c)), the transfer (the trainer's send), the longest gap between two
tokens any client saw during the refit window, and the tokens/s all clients received
over the refit window against (a)'s over a whole phase. The model: a Qwen3-0.6B-shaped
config with random weights (float32 trainer, bf16 server -- float32 on a host without
bf16 GEMMs, see ``server_dtype`` --, TP2), big enough that the
transfer dominates on a 2-core host; ``--model tiny`` for a quick check.

Threads: each server worker has one OpenMP thread bound to its own core (vLLM CPU's
``VLLM_CPU_OMP_THREADS_BIND``); each trainer rank one torch thread. On 2 cores the
background receive, the trainer's send and the clients compete with generation for the
CPU: the tokens/s over the window says how much.

    .venv/bin/python benchmarks/serve_refit.py [--model qwen3-0.6b|tiny] [--clients 4]
        [--refits 3] [--interval 12] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from refit_real_models import MODELS

MODES = ("none", "stop-the-world", "overlapped")
PAUSE_TARGET_S = 0.5  # issue 38: a served refit pauses for its swap, not 5 s
# the Qwen3-0.6B shape of the real-size benchmark (this script's folder is on sys.path),
# its context cut to the server's
QWEN3_0_6B = {**MODELS["qwen3-0.6b"][1], "max_position_embeddings": 512}


# ------------------------------------------------------------------------------ trainer
def trainer(a: argparse.Namespace) -> None:
    """One trainer rank: FSDP2, meets the server, then one refit per ``go{k}`` file."""
    import torch
    import torch.distributed as dist
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from reshard.integrations import hf
    from reshard.integrations.vllm.trainer import ReshardTrainerInitInfo

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.dist_port))
    dist.init_process_group("gloo", rank=a.trainer, world_size=2)
    for turn in range(2):  # one rank at a time holds the whole float32 model, then its shard
        if turn == a.trainer:
            model = hf.load_model(a.model_dir, torch.float32)
            hf.shard_fsdp2(model)
        dist.barrier()
    info = ReshardTrainerInitInfo("127.0.0.1", a.meet_port, trainer_size=2, inference_size=2,
                                  rank=a.trainer, timeout_s=600,
                                  sparse="off")  # the pause of a dense refit
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(a.url), source=model)
    out = Path(a.out)
    if a.trainer == 0:
        (out / "trainer_ready").touch()
    step = 0
    while True:
        step += 1
        go = out / f"go{step}"
        while not go.exists():
            time.sleep(0.02)
        order = json.loads(go.read_text())
        if order.get("stop"):
            break
        with torch.no_grad():  # a new version: every weight changes (its own shard)
            for p in model.parameters():
                p.mul_(1.0 + 1e-3)
        t0 = time.monotonic()
        figures = engine.send_weights(step, overlap=order["overlap"])
        figures.update(start=t0, end=time.monotonic())
        if order.get("save"):  # the reference the server's weights are checked against
            full = hf.full_state_dict(model)
            if a.trainer == 0:
                torch.save(full, out / "last.pt")
            del full
        if a.trainer == 0:
            (out / f".refit{step}").write_text(json.dumps(figures))
            os.replace(out / f".refit{step}", out / f"refit{step}.json")
    engine.shutdown()
    os._exit(0)


# ------------------------------------------------------------------------------- clients
class Load:
    """``n`` streaming clients, each asking its own fixed prompt again and again; every
    token chunk's arrival kept per request."""

    def __init__(self, server, n: int, prompt_tokens: int, max_tokens: int) -> None:
        self.server, self.max_tokens = server, max_tokens
        self.prompts = [[1 + (7 * c + 13 * i) % 5000 for i in range(prompt_tokens)]
                        for c in range(n)]
        self.requests: list[list[tuple[float, int]]] = []  # per request: (time, tokens)
        self.errors: list[str] = []
        self.halt = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(p,), daemon=True)
                        for p in self.prompts]

    def start(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def _client(self, prompt: list[int]) -> None:
        while not self.halt.is_set():
            arrivals: list[tuple[float, int]] = []
            self.requests.append(arrivals)
            try:
                for t, new in self.server.stream(prompt, self.max_tokens):
                    arrivals.append((t, len(new)))
            except Exception as e:  # noqa: BLE001 - counted, the client goes on
                self.errors.append(repr(e))

    def cut_short(self) -> int:
        """Requests that ended with fewer tokens than asked (aborted, or cut by an error)."""
        done = self.requests[:len(self.requests) - len(self.threads)]
        return sum(sum(k for _, k in r) < self.max_tokens for r in done)

    def stop(self) -> None:
        self.halt.set()
        for t in self.threads:
            t.join(600)

    def tokens_between(self, t0: float, t1: float) -> int:
        return sum(k for r in self.requests for t, k in r if t0 <= t < t1)

    def longest_gap(self, t0: float, t1: float) -> float:
        """The longest wait between two chunks of one request, over waits that overlap
        ``[t0, t1]``."""
        gaps = [b[0] - a[0] for r in self.requests for a, b in zip(r, r[1:])
                if b[0] >= t0 and a[0] <= t1]
        return max(gaps, default=0.0)


# ---------------------------------------------------------------------------------- main
def build_model(path: Path, kind: str) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from reshard.integrations import hf

    if kind == "tiny":
        return hf.build_tiny_model(path, "qwen3")
    torch.manual_seed(0)
    config = hf.tiny_config("qwen3", **QWEN3_0_6B)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(path, safe_serialization=True)
    return path


def server_dtype(asked: str) -> str:
    """``auto``: bfloat16 where the CPU multiplies bf16 itself (AVX512-BF16 or AMX). On an
    AVX2-only host oneDNN makes no bf16 matmul and vLLM CPU falls back to torch's bf16
    linear, far slower there: the 0.6B server was not ready within 300 s (its warm-up
    alone), so such a host serves float32."""
    if asked != "auto":
        return asked
    import torch

    fast = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return "bfloat16" if fast else "float32"


def run(a: argparse.Namespace) -> dict:
    from reshard.comm import free_port
    from reshard.tools.serve import Server

    out = Path(a.out or tempfile.mkdtemp(prefix="serve_refit_"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"building the {a.model} model in {out / 'model'}", flush=True)
    model = build_model(out / "model", a.model)
    dtype = server_dtype(a.dtype)
    print(f"server dtype {dtype}", flush=True)
    server = Server(model, port=free_port(), log=out / "server.log", dtype=dtype,
                    kv_cache_bytes=a.kv_cache_mib << 20)
    t_start = time.monotonic()
    with server:
        print(f"server ready in {time.monotonic() - t_start:.0f} s at {server.url}", flush=True)
        dist_port, meet = free_port(), free_port()
        procs = []
        for r in range(2):
            with open(out / f"trainer{r}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "--trainer", str(r), "--model-dir", str(model),
                     "--url", server.url, "--meet-port", str(meet),
                     "--dist-port", str(dist_port), "--out", str(out)],
                    stdout=log, stderr=subprocess.STDOUT))
        try:
            _wait(out / "trainer_ready", procs)
            results = {"modes": {}, "config": vars(a)}
            step = 0
            for mode in MODES:
                load = Load(server, a.clients, a.prompt_tokens, a.max_tokens).start()
                time.sleep(a.warmup)
                t0, refits = time.monotonic(), []
                for _ in range(a.refits):
                    time.sleep(a.interval)
                    if mode == "none":
                        continue
                    step += 1
                    _order(out, step, {"overlap": mode == "overlapped"})
                    refit = json.loads(_wait(out / f"refit{step}.json", procs).read_text())
                    refit["engine"] = server.rpc("reshard_last")  # each rank's own figures
                    refits.append(refit)
                time.sleep(a.interval / 2)
                t1 = time.monotonic()
                load.stop()
                results["modes"][mode] = _measure(load, refits, t0, t1)
                print(f"{mode}: {json.dumps(results['modes'][mode]['summary'])}", flush=True)
            # the last version's weights on every server rank, against vLLM's own loader
            # fed the trainer's full state dict (logical tensors and packed GEMMs)
            step += 1
            _order(out, step, {"overlap": True, "save": True})
            _wait(out / f"refit{step}.json", procs)
            verify = server.rpc("reshard_verify", str(out / "last.pt"))
            results["verify"] = [{k: v[k] for k in ("checked", "mismatched", "live_mismatched")}
                                 for v in verify]
            print(f"weights after the last refit vs vLLM's loader: {results['verify']}")
            results["engine_ranks"] = server.rpc("reshard_last")
            _order(out, step + 1, {"stop": True})
            for p in procs:
                p.wait(120)
        finally:
            for p in procs:
                p.kill()
    base = results["modes"]["none"]["summary"]["tokens_per_s"]
    for m in MODES[1:]:
        s = results["modes"][m]["summary"]
        s["window_vs_none"] = s["window_tokens_per_s"] / base if base else None
    stw, ovl = (results["modes"][m]["summary"] for m in MODES[1:])
    results["pause_ratio"] = ovl["pause_s"] / stw["pause_s"]
    # the engine's own pause: (b) stops it for the whole round, (c) for the finish call
    results["engine_pause_ratio"] = ovl["engine_finish_s"] / stw["pause_s"]
    results["gap_ratio"] = (ovl["longest_gap_s"] / stw["longest_gap_s"]
                            if stw["longest_gap_s"] else None)
    (out / "serve_refit.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    print(f"(results in {out / 'serve_refit.json'})")
    return results


def _measure(load: Load, refits: list[dict], t0: float, t1: float) -> dict:
    per = []
    for r in refits:
        w0, w1 = r["start"], r["end"]
        ranks = r["engine"]
        per.append({"version": r["version"], "pause_s": r["pause_seconds"],
                    "transfer_s": r["transfer_seconds"], "refit_s": w1 - w0,
                    "engine_receive_s": max(x["receive_seconds"] for x in ranks),
                    "engine_prepare_s": max(x.get("prepare_seconds", 0.0) for x in ranks),
                    "engine_swap_s": max(x["swap_seconds"] for x in ranks),
                    # how long the slowest rank kept the engine from its next step
                    "engine_finish_s": max(x["finish_seconds"] for x in ranks),
                    "forwards_during_receive": min(x["forwards_during_receive"] for x in ranks),
                    "same_swap_step": len({x["swap_forward"] for x in ranks}) == 1,
                    "longest_gap_s": load.longest_gap(w0, w1),
                    "window_tokens_per_s": load.tokens_between(w0, w1) / (w1 - w0)})
    summary = {"tokens_per_s": load.tokens_between(t0, t1) / (t1 - t0),
               "requests": len(load.requests), "cut_short": load.cut_short(),
               "client_errors": load.errors[:3],
               "longest_gap_s": max([p["longest_gap_s"] for p in per],
                                    default=load.longest_gap(t0, t1))}
    if per:
        for key in ("pause_s", "transfer_s", "refit_s", "window_tokens_per_s",
                    "engine_receive_s", "engine_prepare_s", "engine_swap_s",
                    "engine_finish_s"):
            summary[key] = statistics.median(p[key] for p in per)
        summary["pause_max_s"] = max(p["pause_s"] for p in per)
        summary["pauses_under_0_5_s"] = sum(p["pause_s"] < PAUSE_TARGET_S for p in per)
    return {"refits": per, "summary": summary}


def table(results: dict) -> str:
    modes = results["modes"]
    rows = ["| mode | pause (s) | pause max (s), under 0.5 s | finish on the engine (s) | "
            "refit (s) | transfer (s) | engine: receive / prepare / swap (s) | "
            "longest token gap (s) | tokens/s in refit window (vs none) |", "|---" * 9 + "|"]
    none = modes["none"]["summary"]
    rows.append(f"| (a) no refit | - | - | - | - | - | - | {none['longest_gap_s']:.3f} | "
                f"{none['tokens_per_s']:.1f} (1.00) |")
    for label, m in (("(b) stop-the-world", "stop-the-world"), ("(c) overlapped", "overlapped")):
        s = modes[m]["summary"]
        under = f"{s['pauses_under_0_5_s']} of {len(modes[m]['refits'])}"
        vs_none = "-" if s["window_vs_none"] is None else f"{s['window_vs_none']:.2f}"
        rows.append(f"| {label} | {s['pause_s']:.3f} | {s['pause_max_s']:.3f}, {under} | "
                    f"{s['engine_finish_s']:.3f} | "
                    f"{s['refit_s']:.3f} | "
                    f"{s['transfer_s']:.3f} | {s['engine_receive_s']:.3f} / "
                    f"{s['engine_prepare_s']:.3f} / {s['engine_swap_s']:.3f} | "
                    f"{s['longest_gap_s']:.3f} | "
                    f"{s['window_tokens_per_s']:.1f} ({vs_none}) |")
    gap = results["gap_ratio"]
    rows.append(f"\npause (c) / (b): {results['pause_ratio']:.3f} as rank 0 of the trainer "
                f"measures it, {results['engine_pause_ratio']:.3f} on the engine (its finish "
                f"call against the whole stop-the-world round); longest gap (c) / (b): "
                f"{gap if gap is None else round(gap, 3)} (medians over "
                f"{len(modes['overlapped']['refits'])} refits each)")
    return "\n".join(rows)


def _order(out: Path, step: int, order: dict) -> None:
    """``go{step}`` for the trainer ranks, whole when it appears (a rank polling for it
    read an empty file once, between its creation and its write)."""
    tmp = out / f".go{step}"
    tmp.write_text(json.dumps(order))
    os.replace(tmp, out / f"go{step}")


def _wait(path: Path, procs: list[subprocess.Popen], timeout: float = 1200) -> Path:
    deadline = time.monotonic() + timeout
    while not path.exists():
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"no {path.name}: a trainer rank exited "
                               f"({[p.returncode for p in dead]}); see its log")
        time.sleep(0.05)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("qwen3-0.6b", "tiny"), default="qwen3-0.6b")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--refits", type=int, default=3, help="refits per mode")
    ap.add_argument("--interval", type=float, default=12.0, help="seconds between refits")
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--kv-cache-mib", type=int, default=256)
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="the server's dtype; auto: bfloat16 where the CPU has bf16 GEMMs "
                         "(AVX512-BF16 or AMX), float32 otherwise")
    ap.add_argument("--out")
    # a trainer rank (started by the benchmark itself)
    ap.add_argument("--trainer", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--meet-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--dist-port", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trainer is not None:
        trainer(a)
    else:
        run(a)


if __name__ == "__main__":
    main()
