"""How many of a model's values, in the engine's dtype, change from one RL step to the
next: the fraction a sparse refit would send (docs/sparse.md, issue 39).

The demo's task (``reshard.tools.rl_task``: its prompts, its reward, one REINFORCE step
on two sampled completions of every prompt), fp32 master weights with AdamW, the
engine's copy in bf16: after every optimizer step each parameter is cast to bf16 and
compared, bit for bit, with its cast after the step before. Reported per tensor kind
(embeddings, attention, MLP, norms), per learning rate, over ``--steps`` steps, each
learning rate from the same initial weights.

Rollouts are sampled from the trainer's own model (temperature 1, a seeded generator):
what changes is decided by the optimizer's updates and the weights' magnitudes, not by
which engine sampled. The weights are not pretrained ones (no network here to fetch
them); ``--init pretrained-like`` gives them a pretrained model's spread (each linear
and embedding row scaled by exp(N(0, 0.3^2)) around transformers' N(0, 0.02) init, each
norm gain exp(N(0, 0.5^2)) instead of all 1.0), since a bf16 value's step (its ulp)
follows its magnitude; ``--init hf`` keeps transformers' init (every norm gain 1.0).

``--fp8`` also measures an FP8 block engine (DeepSeek-V3's format: 128 x 128 blocks,
e4m3 codes, a float32 scale per block, through :func:`reshard.quant.quantize_reference`,
bit for bit what a refit into such an engine sends): of the weights such a checkpoint
holds in FP8 (``reshard.quant.targets.FP8_WEIGHTS``: attention and MLP linears), the
fraction of one-byte codes, of scales and of whole blocks (a code or its scale) that
changed, which is what a sparse refit into an FP8 engine compares and sends; with float32
scales (``amax / 448``, DeepSeek-V3's) and with scales rounded up to powers of two
(``ue8m0``, DeepGEMM's), both from the same run.

    python benchmarks/rl_sparsity.py --model qwen3-0.6b --prefix 32 --out FILE.json
    python benchmarks/rl_sparsity.py --model tiny --fp8 --out FILE.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchtools import write_json  # noqa: E402
from refit_real_models import MODELS  # noqa: E402
from reshard.quant import BlockFormat, quantize_reference  # noqa: E402
from reshard.quant.targets import FP8_WEIGHTS  # noqa: E402
from reshard.tools import rl_task  # noqa: E402

KINDS = ("embeddings", "attention", "mlp", "norms")
SAMPLES = 2  # completions of every prompt a step, as the demo's rollouts


def kind_of(name: str) -> str:
    if "embed_tokens" in name or "lm_head" in name:
        return "embeddings"
    if "norm" in name:
        return "norms"
    if any(p in name for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "attention"
    if any(p in name for p in ("gate_proj", "up_proj", "down_proj")):
        return "mlp"
    return "other"


def build(model: str, init: str, seed: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    from reshard.integrations import hf

    torch.manual_seed(seed)
    if model == "tiny":
        config = hf.tiny_config("qwen3")
    else:
        family, sizes = MODELS[model]
        config = AutoConfig.for_model(family, **sizes)
    net = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if init == "pretrained-like":
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in net.named_parameters():
                if kind_of(name) == "norms":
                    p.copy_(torch.exp(0.5 * torch.randn(p.shape, generator=g)))
                elif p.dim() == 2:
                    p.mul_(torch.exp(0.3 * torch.randn(p.shape[0], 1, generator=g)))
    return net


def prompts(prefix: int) -> list[list[int]]:
    """The demo's prompts, their shared start cut to ``prefix`` tokens."""
    shared = len(rl_task.SYSTEM_PROMPT)
    return [p[:prefix] + p[shared:] for p in rl_task.PROMPTS]


@torch.no_grad()
def sample(net: torch.nn.Module, batch: list[list[int]], step: int) -> list:
    """``SAMPLES`` completions of ``rl_task.ROLLOUT_TOKENS`` tokens of every prompt."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for prompt in batch:
        ids = torch.tensor([prompt] * SAMPLES)
        res = net(input_ids=ids, use_cache=True)
        past, completion = res.past_key_values, []
        for _ in range(rl_task.ROLLOUT_TOKENS):
            probs = res.logits[:, -1].float().softmax(-1)
            tok = torch.multinomial(probs, 1, generator=g)
            completion.append(tok)
            res = net(input_ids=tok, past_key_values=past, use_cache=True)
            past = res.past_key_values
        tokens = torch.cat(completion, 1).tolist()
        out += [(list(prompt), t) for t in tokens]
    return out


def bf16_bits(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16).view(torch.int16).clone()
            for n, p in net.named_parameters()}


FP8_PARTS = ("codes", "scales", "blocks")
FP8_FORMATS = {"fp8": BlockFormat(), "fp8_ue8m0": BlockFormat(ue8m0=True)}


def fp8_bits(net: torch.nn.Module, fmt: BlockFormat
             ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each FP8 checkpoint weight as an FP8 block engine holds it: its codes' bits and
    its float32 scales' bits."""
    out = {}
    for n, p in net.named_parameters():
        if FP8_WEIGHTS.match(n):
            q, scale = quantize_reference(p.detach(), fmt)
            out[n] = (q.view(torch.uint8), scale.view(torch.int32).clone())
    return out


def fp8_changed(before: dict, after: dict) -> dict[str, dict[str, int]]:
    """Per kind: codes, scales and blocks (128 x 128, a code or its scale) changed, and
    how many there are of each."""
    out: dict[str, dict[str, int]] = {}
    for n, (q, s) in after.items():
        q0, s0 = before[n]
        rows, cols = s.shape
        diff = q != q0
        padded = torch.zeros(rows * 128, cols * 128, dtype=torch.bool)
        padded[:q.shape[0], :q.shape[1]] = diff
        blocks = padded.view(rows, 128, cols, 128).any(dim=3).any(dim=1) | (s != s0)
        k = out.setdefault(kind_of(n), {f"{x}{y}": 0 for x in FP8_PARTS for y in ("", "_n")})
        for part, changed, total in (("codes", diff, q), ("scales", s != s0, s),
                                     ("blocks", blocks, s)):
            k[part] += int(changed.sum())
            k[part + "_n"] += total.numel()
    return out


def run(args: argparse.Namespace, lr: float) -> dict:
    net = build(args.model, args.init, args.seed)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, foreach=False)
    batch, before = prompts(args.prefix), bf16_bits(net)
    fp8_before = {f: fp8_bits(net, fmt) for f, fmt in FP8_FORMATS.items()} if args.fp8 else None
    sizes = {k: 0 for k in KINDS}
    for n, b in before.items():
        sizes[kind_of(n)] = sizes.get(kind_of(n), 0) + b.numel()
    steps = []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        loss, mean_reward = rl_task.reinforce_step(net, opt, sample(net, batch, step))
        after = bf16_bits(net)
        changed = {k: 0 for k in sizes}
        for n, b in after.items():
            changed[kind_of(n)] += int((b != before[n]).sum())
        before = after
        total = sum(changed.values()) / sum(sizes.values())
        steps.append({"step": step, "loss": loss, "reward": mean_reward,
                      "changed": {k: changed[k] / sizes[k] for k in sizes if sizes[k]},
                      "total": total, "seconds": time.perf_counter() - t0})
        line = (f"lr {lr:g} step {step}: {total:.2%} changed "
                + " ".join(f"{k} {v:.2%}" for k, v in steps[-1]["changed"].items()))
        for f, fmt in FP8_FORMATS.items() if fp8_before is not None else ():
            fp8_after = fp8_bits(net, fmt)
            per_kind = fp8_changed(fp8_before[f], fp8_after)
            fp8_before[f] = fp8_after
            fp8 = {k: {p: c[p] / c[p + "_n"] for p in FP8_PARTS} for k, c in per_kind.items()}
            fp8["all"] = {p: sum(c[p] for c in per_kind.values())
                          / sum(c[p + "_n"] for c in per_kind.values()) for p in FP8_PARTS}
            steps[-1][f] = fp8
            line += f"; {f} " + " ".join(f"{p} {fp8['all'][p]:.2%}" for p in FP8_PARTS)
        print(line + f" ({time.perf_counter() - t0:.1f} s)", flush=True)
    return {"lr": lr, "elements": sizes, "steps": steps}


def table(runs: list[dict]) -> str:
    """Mean (min-max) over the steps of the fraction changed, per kind and in all."""
    kinds = [k for k in (*KINDS, "other") if runs and runs[0]["elements"].get(k)]
    head = "| lr | " + " | ".join(kinds) + " | all |"
    rows = [head, "|" + "---|" * (len(kinds) + 2)]
    for r in runs:
        def cell(values: list[float]) -> str:
            return (f"{sum(values) / len(values):.2%} ({min(values):.2%}-"
                    f"{max(values):.2%})")
        rows.append(f"| {r['lr']:g} | " + " | ".join(
            cell([s["changed"][k] for s in r["steps"]]) for k in kinds)
            + f" | {cell([s['total'] for s in r['steps']])} |")
    return "\n".join(rows)


def fp8_table(runs: list[dict]) -> str:
    """Mean (min-max) over the steps, per scale format: the FP8 codes changed per kind
    of the weights an FP8 checkpoint quantizes, and in all of them the codes, scales
    and blocks."""
    kinds = [k for k in (*KINDS, "other") if k in runs[0]["steps"][0]["fp8"]]
    cols = [(k, "codes") for k in kinds] + [("all", p) for p in FP8_PARTS]
    head = "| scales | lr | " + " | ".join(f"{k} {p}" for k, p in cols) + " |"
    rows = [head, "|" + "---|" * (len(cols) + 2)]
    for f in FP8_FORMATS:
        for r in runs:
            cells = []
            for k, p in cols:
                v = [s[f][k][p] for s in r["steps"]]
                cells.append(f"{sum(v) / len(v):.2%} ({min(v):.2%}-{max(v):.2%})")
            scales = "ue8m0" if f.endswith("ue8m0") else "float32"
            rows.append(f"| {scales} | {r['lr']:g} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["tiny", *MODELS], default="tiny")
    p.add_argument("--lrs", default="1e-6,3e-6,1e-5")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prefix", type=int, default=len(rl_task.SYSTEM_PROMPT),
                   help="tokens of the shared prompt start kept (default: all 300)")
    p.add_argument("--init", choices=("pretrained-like", "hf"), default="pretrained-like")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared 2-core host two threads "
                        "spin against each other, 27 s a tiny step against 0.5 s)")
    p.add_argument("--fp8", action="store_true",
                   help="also the codes, scales and blocks an FP8 block engine would see "
                        "change (the attention and MLP linears)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = [run(args, float(lr)) for lr in args.lrs.split(",")]
    print(f"\n{args.model}, init {args.init}, {args.steps} steps, prompts of "
          f"{args.prefix} shared + own tokens, {SAMPLES} x {rl_task.ROLLOUT_TOKENS}-token "
          "rollouts each: bf16 values changed per step, mean (min-max)")
    print(table(runs))
    if args.fp8:
        print("\nFP8 block engine (128 x 128 blocks, e4m3 codes; float32 or ue8m0 scales) of the "
              "attention and MLP linears: changed per step, mean (min-max)")
        print(fp8_table(runs))
    if args.out:
        write_json(args.out, {"model": args.model, "init": args.init, "args": vars(args)
                              | {"out": str(args.out)}, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
