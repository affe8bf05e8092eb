"""The tables and the plot of ``benchmarks/refit_real.py``'s results.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from benchtools import median, pyplot
from refit_real_models import METHODS


def table(results: list[dict]) -> str:
    rows = ["| model | params | method | refit (median) | vs reshard | received per engine "
            "rank | trainer rank 0 peak extra | engine ranks peak extra | check | load |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ms = r["methods"]
        base = ms.get("reshard", {}).get("median")
        for name, m in ms.items():
            if "median" not in m:  # reshard_sparse: its own table (sparse_table)
                continue
            ratio = f"{m['median'] / base:.2f}x" if base else "-"
            rows.append(
                f"| {r['model']} | {r['params'] / 1e9:.2f}B | {name} | {m['median']:.3f} s "
                f"| {ratio} | {' / '.join(_mb(b) for b in m['bytes_received'])} "
                f"| {_mb(m['trainer0_peak_extra'])} "
                f"| {' / '.join(_mb(b) for b in m['engine_peak_extra'])} "
                f"| {'OK' if m['check']['ok'] else 'FAIL'} | {m['load']} |")
        if "reshard" in ms:
            f = ms["reshard"]["floor"]
            rows.append(f"| {r['model']} | | floor | {median(f['seconds']):.3f} s "
                        f"| {median(f['seconds']) / base:.2f}x "
                        f"| {' / '.join(_mb(b) for b in ms['reshard']['expected_bytes'])} "
                        "| | | | |")
    return "\n".join(rows)


def breakdown(results: list[dict]) -> str:
    rows = ["| model | refit (median) | set-up (meet + plan, once) | transfer (engine receive) "
            "| floor | commit (vLLM reload) | rest (driver, RPC) |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        m = r["methods"].get("reshard")
        if not m:
            continue
        b = {k: median([d[k] for d in m["breakdown"]]) for k in m["breakdown"][0]}
        rows.append(f"| {r['model']} | {m['median']:.3f} s | {m['init_seconds']:.2f} s "
                    f"| {b['receive']:.3f} s | {median(m['floor']['seconds']):.3f} s "
                    f"| {b['commit']:.3f} s | {m['median'] - b['engine_total']:.3f} s |")
    return "\n".join(rows)


def sparse_table(results: list[dict]) -> str:
    """reshard_sparse, per fraction changed: the trainer ranks' wire bytes against the
    dense bytes they replaced; the sparse and dense refits' seconds before vLLM's commit
    (the slower trainer rank's ``refit()``: detection, encoding, the wire, the engine's
    applying into its staging; a dense refit's keeping of the sender's copy left out and
    shown as "copy s", as ``sparse_refit.py`` does) and with it (the driver's wall clock,
    as the other methods); the slower trainer rank's detection, the slower engine rank's
    decoding and applying, vLLM's commit (the slower engine rank's). Medians."""
    rows = ["| model | changed (measured) | sparse bytes | dense bytes | bytes ratio "
            "| sparse s before commit | dense s before commit | ratio "
            "| sparse s with commit | dense s with commit | ratio | detect s | apply s "
            "| commit s: sparse / dense | copy s | encodings (regions) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        m = r["methods"].get("reshard_sparse")
        for row in m["changed"] if m else ():
            sp, de = row["sparse"], row["dense"]
            last = [t["sparse"] for t in sp[-1]["trainer"]]
            sent = median([sum(t["sent"] for t in d["trainer"]) for d in sp])
            dense = sum(t["dense_bytes"] for t in last)
            measured = sum(t["changed"] for t in last) / sum(t["elements"] for t in last)
            before = (_slowest(sp, "trainer", lambda t: t["transfer_seconds"]),
                      _slowest(de, "trainer", lambda t: t["transfer_seconds"]
                               - t["copy_seconds"]))
            wall = (median([d["seconds"] for d in sp]), median([d["seconds"] for d in de]))
            enc: dict[str, int] = {}
            for t in last:
                for k, v in t["regions_by_encoding"].items():
                    enc[k] = enc.get(k, 0) + v
            rows.append(
                f"| {r['model']} | {row['changed']:.1%} ({measured:.2%}) | {_mb(sent, 2)} "
                f"| {_mb(dense, 1)} | {sent / dense:.3f}x | {before[0]:.3f} | {before[1]:.3f} "
                f"| {before[0] / before[1]:.2f}x | {wall[0]:.3f} | {wall[1]:.3f} "
                f"| {wall[0] / wall[1]:.2f}x "
                f"| {_slowest(sp, 'trainer', lambda t: t['sparse']['seconds']):.3f} "
                f"| {_slowest(sp, 'engine', lambda e: e['sparse']['seconds']):.3f} "
                f"| {_slowest(sp, 'engine', lambda e: e['commit_seconds']):.3f} / "
                f"{_slowest(de, 'engine', lambda e: e['commit_seconds']):.3f} "
                f"| {_slowest(de, 'trainer', lambda t: t['copy_seconds']):.3f} "
                f"| {', '.join(f'{k} {v}' for k, v in sorted(enc.items()))} |")
    return "\n".join(rows)


def _slowest(refits: list[dict], side: str, value: Callable[[dict], float]) -> float:
    """The median over ``refits`` of the slowest rank's ``value`` on ``side``."""
    return median([max(value(x) for x in d[side]) for d in refits])


#: The roles of :func:`_role`, in the CPU table's order.
ROLES = ("trainer ranks", "engine workers", "engine core", "driver")


def cpu_table(results: list[dict]) -> str:
    """CPU seconds per refit (medians), by process role, and the cores they kept busy
    (CPU seconds over wall seconds): what a method costs the host beyond its time."""
    rows = ["| model | method | refit (median) | " + " | ".join(ROLES)
            + " | CPU in all | cores busy | page faults: engine workers | trainer ranks |",
            "|---|---|---|" + "---|" * (len(ROLES) + 4)]
    for r in results:
        ms = dict(r["methods"])
        if "reshard" in ms:
            ms["floor"] = dict(ms["reshard"]["floor"], median=median(
                ms["reshard"]["floor"]["seconds"]))
        for name, m in ms.items():
            cpu = m.get("cpu_seconds")
            if not cpu:
                continue
            total = sum(cpu.get(k, 0.0) for k in ROLES)
            rows.append(f"| {r['model']} | {name} | {m['median']:.3f} s | "
                        + " | ".join(f"{cpu.get(k, 0.0):.2f} s" for k in ROLES)
                        + f" | {total:.2f} s | {total / m['median']:.2f} "
                        + f"| {cpu.get('faults engine workers', 0) / 1e3:,.0f}k "
                        + f"| {cpu.get('faults trainer ranks', 0) / 1e3:,.0f}k |")
    return "\n".join(rows)


def _mb(n: float, digits: int = 0) -> str:
    return f"{n / 1e6:,.{digits}f} MB"


def plot(results: list[dict], png: Path) -> None:
    plt = pyplot()
    dense = sorted((r for r in results if "moe" not in r["model"]), key=lambda r: r["params"])
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for method in (*METHODS, "floor"):
        pts = [(r["params"] / 1e9, _seconds(r, method)) for r in dense]
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=method)
    ax.set_xlabel("parameters (billions; FSDP2 fp32 x2 -> vLLM TP2 bf16)")
    ax.set_ylabel("refit seconds (median)")
    ax.set_title("Refit into vLLM CPU on a 2-core host")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def _seconds(r: dict, method: str) -> float | None:
    if method == "floor":
        m = r["methods"].get("reshard")
        return median(m["floor"]["seconds"]) if m else None
    m = r["methods"].get(method)
    return m["median"] if m else None
