"""The report: every wrong result (what makes the exit status 1), the JSON with its
derived numbers and summary, and the short text table that is also printed."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .packing import PACKING_GOAL
from .results import ERROR, FAIL, SKIPPED, Results


def mismatches(results: Results) -> list[str]:
    """Every wrong result: what makes the exit status 1."""
    bad = [c.name for c in (*results.checks, *results.probes) if c.status == FAIL]
    bad += [f"packing {p.workload} {p.side}" for p in results.packing if p.status == FAIL]
    bad += [f"pytest {r.file}" for r in results.pytest_runs if r.status == FAIL]
    if results.copy.get("status") == FAIL:
        bad.append("reference copy")
    return bad


def exit_code(results: Results) -> int:
    """1 on a wrong result, else 0 (skips and errors of the environment included)."""
    return 1 if mismatches(results) else 0


def _packing_rows(results: Results) -> list[dict[str, Any]]:
    copy_gbps = results.copy.get("gbps")
    rows = []
    for p in results.packing:
        row = asdict(p)
        gbps = p.nbytes / p.seconds / 1e9 if p.seconds > 0 else None
        fraction = gbps / copy_gbps if gbps is not None and copy_gbps else None
        row.update(gbps=gbps, fraction_of_copy=fraction,
                   meets_goal=None if fraction is None else fraction >= PACKING_GOAL)
        rows.append(row)
    return rows


def _summary(results: Results, packing: list[dict[str, Any]]) -> dict[str, Any]:
    everything = [*results.features, *results.checks, *results.probes, *results.packing,
                  *results.pytest_runs]
    fractions = [r["fraction_of_copy"] for r in packing if r["fraction_of_copy"] is not None]
    return {
        "ok": not mismatches(results), "mismatches": mismatches(results),
        "errors": [getattr(x, "name", None) or getattr(x, "file", None)
                   or f"{x.workload} {x.side}" for x in everything if x.status == ERROR],
        "num_skipped": sum(x.status == SKIPPED for x in everything),
        "packing_goal": PACKING_GOAL,
        "packing_worst_fraction": min(fractions, default=None),
        "packing_below_goal": [f"{r['workload']} {r['side']}" for r in packing
                               if r["meets_goal"] is False],
        "exit_code": exit_code(results)}


def build_report(results: Results) -> tuple[dict[str, Any], str]:
    """The JSON report and the text table of ``results``."""
    packing = _packing_rows(results)
    report = asdict(results)
    report["packing"] = packing
    report["not_run"] = [{"file": f, "reason": why} for f, why in results.not_run]
    report["label"] = ("GPU measurement" if results.mode == "gpu"
                       else "CPU DEBUG RUN: not a GPU measurement")
    report["summary"] = _summary(results, packing)
    return report, render_table(report)


def _fmt(value: Any, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _header_lines(r: dict[str, Any]) -> list[str]:
    env, copy = r["env"], r["copy"]
    lines = [f"gpu_check ({r['label']})",
             f"{env.get('device_name')} ({env['device']}), torch {env['torch']}, CUDA "
             f"{env.get('torch_cuda')}, NCCL {env.get('nccl', '-')}, Python {env['python']}"]
    if copy.get("gbps") is not None:
        lines.append(f"copy bandwidth: {copy['nbytes'] / 2**20:.0f} MiB copy_ on the device, "
                     f"{copy['gbps']:.1f} GB/s, {'verified' if copy['verified'] else 'WRONG'}")
    else:
        lines.append(f"copy bandwidth: not measured ({copy.get('detail', 'no result')})")
    return lines


def _packing_lines(r: dict[str, Any]) -> list[str]:
    s = r["packing_setup"]
    if not s:
        return []
    lines = ["", f"packing: {s['model']} ({s['dtype']}), {s['src']} -> {s['dst']}, "
                 f"{s['schedule']} schedule, staging budget {s['budget_bytes'] >> 20} MiB, "
                 f"at most {s['max_bytes'] / 2**30:.1f} GiB per workload, "
                 f"{r['packing'][0]['packer'] if r['packing'] else s['packer']} stager",
             "layers: as many decoder layers as fit in that memory (embeddings, lm_head "
             "and final norm whole); pack: first source rank, unpack: first destination rank",
             f"{'workload':<16} {'side':<7}{'rank':>5}{'layers':>8}{'regions':>9}{'MiB':>10}"
             f"{'GB/s':>10}{'of copy':>9}  status"]
    for p in r["packing"]:
        lines.append(
            f"{p['workload']:<16} {p['side']:<7}{p['rank']:>5}{p['layers']:>8}"
            f"{p['num_regions']:>9}{p['nbytes'] / 2**20:>10.1f}{_fmt(p['gbps'], '.1f'):>10}"
            f"{_fmt(p['fraction_of_copy'], '.1%'):>9}  {p['status']} {p['detail']}".rstrip())
    below = r["summary"]["packing_below_goal"]
    lines.append(f"goal: >= {PACKING_GOAL:.0%} of copy bandwidth; "
                 + (f"below it: {', '.join(below)}" if below else "all measured rows meet it"))
    return lines


def _check_lines(title: str, checks: list[dict[str, Any]]) -> list[str]:
    if not checks:
        return []
    width = max(len(c["name"]) for c in checks)
    lines = ["", title, f"{'check':<{width}}  {'status':<8}{'seconds':>8}  detail"]
    lines += [f"{c['name']:<{width}}  {c['status']:<8}{c['seconds']:>8.2f}  {c['detail']}"
              for c in checks]
    return lines


def _pytest_lines(r: dict[str, Any], max_skips: int = 20) -> list[str]:
    runs, lines = r["pytest_runs"], [""]
    if runs:
        width = max(len(x["file"]) for x in runs)
        lines += [f"pytest: {len(runs)} test files",
                  f"{'file':<{width}}  {'status':<8}{'passed':>7}{'failed':>7}{'errors':>7}"
                  f"{'skipped':>8}{'seconds':>9}"]
        lines += [f"{x['file']:<{width}}  {x['status']:<8}{x['passed']:>7}{x['failed']:>7}"
                  f"{x['errors']:>7}{x['skipped']:>8}{x['seconds']:>9.1f}  {x['detail']}"
                  for x in runs]
        problems = [f for x in runs for f in x["failures"]]
        lines += [f"  failed: {f}" for f in problems]
        skips = [s for x in runs for s in x["skips"]]
        lines += [f"  skipped: {s}" for s in skips[:max_skips]]
        if len(skips) > max_skips:
            lines.append(f"  ... {len(skips) - max_skips} more skipped tests in the JSON")
    lines.append("test files not run:")
    lines += [f"  {x['file']}: {x['reason']}" for x in r["not_run"]]
    return lines


def render_table(report: dict[str, Any]) -> str:
    """The short text report (also printed)."""
    summary = report["summary"]
    lines = _header_lines(report) + _packing_lines(report)
    lines += _check_lines(f"correctness on {report['env']['device']}", report["checks"])
    lines += _check_lines("several ranks on one GPU", report["probes"])
    lines += _check_lines(f"torch {report['env']['torch']}: what the library uses",
                          report["features"])
    lines += _pytest_lines(report)
    verdict_line = ("OK: no wrong result" if summary["ok"] else
                    f"WRONG RESULTS: {', '.join(summary['mismatches'])}")
    lines += ["", f"result: {verdict_line}; {len(summary['errors'])} errors, "
                  f"{summary['num_skipped']} skipped; {report['seconds']:.0f} s "
                  f"({report['label']})"]
    return "\n".join(lines) + "\n"


def write_report(out: Path, report: dict[str, Any], table: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "gpu_check.txt").write_text(table)
