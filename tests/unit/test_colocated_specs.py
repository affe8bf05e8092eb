"""The colocated transport's exports, one unit at a time: host exports are named by a
token never given twice (a freed storage's fd number and address come back); a CUDA
export is mapped through torch's ``rebuild_cuda_tensor`` with this process's index of
the exporter's GPU (by UUID), read in place by a rank of the exporting process, and a
GPU this process cannot see is refused by name. (The CUDA IPC itself needs a GPU:
``benchmarks/gpu_check.py`` runs it.)"""

from __future__ import annotations

import gc
import inspect
import os

import pytest
import torch
import torch.multiprocessing.reductions as reductions

import reshard as R
import reshard._transport.shm as shm


class _Rank0:
    """What the runner reads of its group before any message: the rank."""

    rank = 0


def _runner() -> shm.SharedMemoryRunner:
    layout = R.Layout((4, 4), R.Mesh([0]), [R.Replicate()])
    return shm.SharedMemoryRunner(R.plan(layout, layout), _Rank0())


def test_host_exports_get_a_new_token_each_time_one_per_storage():
    a = torch.arange(8.0)
    tokens: dict[int, int] = {}
    first, view = shm._export_spec(a, tokens), shm._export_spec(a[2:], tokens)
    assert first[0] == "cpu" and first[1] == os.getpid()
    assert first[2] == view[2]  # one storage, one token within an export
    assert (first[5], view[5]) == (0, 2)  # storage offsets
    del a, view
    gc.collect()
    again = shm._export_spec(torch.arange(8.0), {})
    assert again[2] != first[2]  # even if fd number and address are those of the freed one


def test_a_cuda_export_read_in_its_own_process_is_the_tensor_itself():
    t = torch.arange(6.0)
    token = next(shm._TOKENS)
    shm._IN_PROCESS[token] = t
    assert _runner()._map(("cuda", os.getpid(), token, "GPU-x", ())) is t
    del t
    gc.collect()
    with pytest.raises(R.TransferError, match="freed before it was read"):
        _runner()._map(("cuda", os.getpid(), token, "GPU-x", ()))


def test_a_cuda_export_is_rebuilt_on_this_process_s_index_of_its_gpu(monkeypatch):
    real = inspect.signature(reductions.rebuild_cuda_tensor)
    names = list(real.parameters)
    seen = {}

    def rebuild(*args, **kwargs):  # stands in for the IPC mapping a GPU would do
        seen.update(real.bind(*args, **kwargs).arguments)
        return torch.zeros(3)

    rebuild.__signature__ = real
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    monkeypatch.setattr(shm, "_cuda_index", lambda uuid: {"GPU-b": 1}[uuid])
    args = tuple(f"arg-{n}" for n in names)  # as reduce_tensor gives them, in order
    view = _runner()._map(("cuda", os.getpid() + 1, 0, "GPU-b", args))
    assert view.shape == (3,)
    assert seen["storage_device"] == 1  # the exporter's index replaced by ours
    assert {k: v for k, v in seen.items() if k != "storage_device"} == {
        n: f"arg-{n}" for n in names if n != "storage_device"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_a_gpu_this_process_cannot_see_is_refused_by_name():
    with pytest.raises(R.TransferError, match=r"no GPU GPU-123 in this process.*"
                                              r"CUDA_VISIBLE_DEVICES"):
        shm._cuda_index("GPU-123")


def test_tensors_on_other_devices_are_refused_by_name():
    with pytest.raises(R.TransferError, match="reads CPU and CUDA tensors, got one on meta"):
        shm._export_spec(torch.empty(3, device="meta"), {})
