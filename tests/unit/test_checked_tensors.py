"""``CheckedTensors``: a refit side checks its tensors before every refit, and skips the
check where they are the ones the last check passed. Whatever happens to the tensors
between refits, its answer is the full check's (``local_problem``), and it skips only
where nothing the check reads changed."""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import reshard as R
from reshard import executor
from reshard.executor import CheckedTensors, local_problem

SRC = R.Layout((8, 6), R.Mesh([0, 1]), [R.Shard(0)], dtype="float32")
DST = R.Layout((8, 6), R.Mesh([0, 1]), [R.Shard(1)], dtype="bfloat16")
NORM = R.Layout((6,), R.Mesh([0, 1]), [R.Replicate()], dtype="float32")
PLAN = R.plan({"w": SRC, "n": NORM}, {"w": DST, "n": NORM}, allow_cast=True)

# what may happen to rank 0's tensors between two refits
CHANGES = ["same", "new memory", "wrong shape", "wrong dtype", "requires grad",
           "grad mode off", "missing", "not a tensor", "aliased", "in place"]


def _fresh() -> tuple[dict, dict]:
    return ({"w": torch.randn(4, 6), "n": torch.ones(6)},
            {"w": torch.zeros(8, 3, dtype=torch.bfloat16), "n": torch.zeros(6)})


def _change(kind: str, src: dict, dst: dict) -> tuple[dict, dict, bool]:
    """The tensors after ``kind`` (new dicts), and whether grad mode is on."""
    src, dst, grad = dict(src), dict(dst), True
    if kind == "new memory":
        src["w"] = src["w"].clone()
    elif kind == "wrong shape":
        dst["w"] = torch.zeros(8, 4, dtype=torch.bfloat16)
    elif kind == "wrong dtype":
        src["n"] = torch.ones(6, dtype=torch.float64)
    elif kind in ("requires grad", "grad mode off"):  # the same tensor, its flag set
        dst["n"].requires_grad_(True)  # (cleared again once checked)
        grad = kind == "requires grad"
    elif kind == "missing":
        del dst["n"]
    elif kind == "not a tensor":
        src["w"] = [[0.0] * 6] * 4
    elif kind == "aliased":  # two destinations sharing memory
        dst["w"] = torch.zeros(8, 3, dtype=torch.bfloat16)
        dst["n"] = dst["w"].view(-1)[:12].view(torch.float32)
    elif kind == "in place" and isinstance(src["w"], torch.Tensor):
        src["w"].add_(1.0)  # values change, nothing the check reads does
    return src, dst, grad


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(CHANGES), min_size=1, max_size=8))
@example(["requires grad"])  # the same memory, only its flag changed
@example(["grad mode off", "requires grad"])  # passed without grad mode, then with it
def test_the_answer_is_always_the_full_checks(changes):
    checked = CheckedTensors(PLAN, 0)
    good_src, good_dst = _fresh()
    src, dst = good_src, good_dst
    assert checked.problem(src, dst) is None
    for kind in changes:
        base = (good_src, good_dst) if kind != "in place" else (src, dst)
        src, dst, grad = _change(kind, *base)
        with torch.set_grad_enabled(grad):
            want = local_problem(PLAN, 0, src, dst)
            assert checked.problem(src, dst) == want, kind
        good_dst["n"].requires_grad_(False)


def test_it_skips_only_tensors_the_last_check_passed(monkeypatch):
    calls = []
    real = executor.local_problem
    monkeypatch.setattr(executor, "local_problem",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    checked = CheckedTensors(PLAN, 0)
    src, dst = _fresh()
    assert checked.problem(src, dst) is None and len(calls) == 1
    src["w"].mul_(2.0)  # an optimizer step: the same memory
    assert checked.problem(dict(src), dict(dst)) is None and len(calls) == 1
    bad = dict(dst, w=torch.zeros(8, 4, dtype=torch.bfloat16))
    for _ in range(2):  # a refused refit is checked (and refused) again
        assert "local shape [8, 4]" in checked.problem(src, bad)
    assert len(calls) == 3
    assert checked.problem(src, dst) is None and len(calls) == 4  # checked once more
    assert checked.problem(src, dst) is None and len(calls) == 4
