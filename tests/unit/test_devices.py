"""Tensors on a device the group's backend cannot carry are refused before any byte
moves, on every rank.

Gloo reads a tensor through its raw pointer (a CUDA tensor would be read as host
memory) and NCCL cannot send host memory; this machine has no GPU, so the refusal is
shown with host tensors handed to a group that reports the NCCL backend (the in-process
group of ``_inproc``, which moves nothing itself), and the backend parsing on its own."""

from __future__ import annotations

import pytest
import torch

import reshard as R
from reshard.comm import backend_device_types
from reshard.executor import Executor, local_problem

from ._inproc import ThreadComm, run_ranks


@pytest.mark.parametrize("backend, kinds", [
    ("gloo", {"cpu"}),
    ("nccl", {"cuda"}),
    ("NCCL", {"cuda"}),
    ("cpu:gloo,cuda:nccl", {"cpu", "cuda"}),
    ("cuda:nccl", {"cuda"}),
    ("mpi", None),
    ("", None),
    (None, None),
])
def test_backend_device_types(backend, kinds):
    got = backend_device_types(backend)
    assert (None if got is None else set(got)) == kinds


def _problem():
    src_l = R.Layout((8, 4), R.Mesh([0, 1]), [R.Shard(0)], dtype="float32")
    dst_l = R.Layout((8, 4), R.Mesh([2, 3]), [R.Shard(1)], dtype="float32")
    plan = R.plan({"w": src_l}, {"w": dst_l})
    full = torch.arange(32, dtype=torch.float32).view(8, 4)
    tensors = {r: ({"w": src_l.shard(full, r)} if r < 2 else {},
                   {"w": torch.full((8, 2), -1.0)} if r >= 2 else {}) for r in range(4)}
    return plan, tensors


def test_local_problem_names_tensor_device_and_backend():
    plan, tensors = _problem()
    assert local_problem(plan, 0, *tensors[0], backend="gloo") is None
    assert local_problem(plan, 0, *tensors[0], backend="cpu:gloo,cuda:nccl") is None
    assert local_problem(plan, 0, *tensors[0], backend="mpi") is None  # unknown: unchecked
    msg = local_problem(plan, 0, *tensors[0], backend="nccl")
    assert msg == ("source tensor 'w' is on cpu, which the nccl backend cannot send or "
                   "receive (it carries cuda tensors)")
    msg = local_problem(plan, 3, *tensors[3], backend="nccl")
    assert msg is not None and msg.startswith("destination tensor 'w' is on cpu")


def test_wrong_device_refused_on_every_rank_nothing_moved():
    plan, tensors = _problem()
    before = {r: {n: t.clone() for n, t in dst.items()} for r, (_, dst) in tensors.items()}

    def rank_fn(comm: ThreadComm):
        comm.backend = "nccl"  # a group that can only carry CUDA tensors
        return Executor(plan, comm, method="p2p").run(*tensors[comm.rank])

    results = run_ranks(4, rank_fn)
    for ok, err in results:
        assert not ok and isinstance(err, R.TensorMismatchError), err
        assert "is on cpu, which the nccl backend cannot send or receive" in str(err)
        assert str(err).endswith("nothing was moved")
    for r, (_, dst) in tensors.items():
        for n, t in dst.items():
            assert torch.equal(t, before[r][n])
