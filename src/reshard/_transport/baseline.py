"""The conventional refit path, for comparison: gather-and-broadcast.

Per bucket of tensors (packed, like the best broadcast implementations): the source
ranks all-gather their shards, the first source rank rebuilds the full tensors and
broadcasts them in one packed buffer to every destination rank, and each destination
keeps its slice. Every destination receives every full tensor.

The staging buffers of each bucket are made once and reused by every run, as a GPU
implementation gets them from the caching allocator: on the host, a fresh buffer of
hundreds of MiB is fresh pages from the kernel on every refit, a cost the conventional
path does not pay on GPUs and which would flatter the comparison.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from reshard._transport.runner import RunStats
from reshard.comm import Comm
from reshard.layout import box_slices
from reshard.planner import Plan
from reshard.stats import distinct_shard_slots
from reshard.tensor_plan import TensorPlan

__all__ = ["GatherBroadcast"]



def _buckets(plan: Plan, bucket_bytes: int) -> list[list[TensorPlan]]:
    out: list[list[TensorPlan]] = []
    key, size = None, 0
    for t in plan.tensors:
        k = (t.src.ranks, t.dst.rank_set)
        nbytes = t.src.numel * t.dst.itemsize
        if k != key or size + nbytes > bucket_bytes:
            out.append([])
            key, size = k, 0
        out[-1].append(t)
        size += nbytes
    return out


def _gather_slots(bucket: list[TensorPlan]) -> list[int]:
    """Source slots whose shards together hold every tensor of the bucket (one replica)."""
    return sorted(set().union(*(distinct_shard_slots(t.src) for t in bucket)))


class GatherBroadcast:
    """One rank's executor of the gather-and-broadcast baseline for one plan."""

    def __init__(self, plan: Plan, comm: Comm, dtypes: Mapping[str, torch.dtype], *,
                 bucket_bytes: int) -> None:
        self.comm, self.rank, self.dtypes = comm, comm.rank, dtypes
        self.buckets = _buckets(plan, bucket_bytes)
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.groups = []
        for bucket in self.buckets:  # same order on every rank
            t = bucket[0]
            slots = _gather_slots(bucket)
            ranks = [t.src.ranks[s] for s in slots]
            root = min(ranks)
            gather = comm.subgroup(ranks) if len(ranks) > 1 else None
            bcast_ranks = sorted({root} | t.dst.rank_set)
            bcast = comm.subgroup(bcast_ranks) if len(bcast_ranks) > 1 else None
            self.groups.append((root, gather, bcast, bcast_ranks, slots, ranks))

    def _buffer(self, *key: Any, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A staging buffer kept across runs (one per bucket and use)."""
        buf = self._buffers.get(key)
        if buf is None or buf.numel() != numel or buf.dtype != dtype or buf.device != device:
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf

    def run(self, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]) -> RunStats:
        stats = RunStats()
        device = next(iter([*src.values(), *dst.values()]), torch.empty(0)).device
        for bi, (bucket, group) in enumerate(zip(self.buckets, self.groups)):
            root, gather, bcast, bcast_ranks, slots, ranks = group
            if self.rank not in bcast_ranks and self.rank not in ranks:
                continue
            full = None
            packed = self._packed(bi, bucket, device) if bcast is not None else None
            if self.rank in ranks:
                full = self._gather(bi, bucket, src, gather, root, slots, device, stats,
                                    packed)
            if bcast is not None:
                full = self._broadcast(bi, packed, full, bcast, bcast_ranks.index(root),
                                       stats)
            if self.rank in bucket[0].dst.rank_set:
                self._keep(bucket, full, dst)
            held = sum(f.numel() * f.element_size() for f in full) if full else 0
            stats.peak_staging_bytes = max(stats.peak_staging_bytes, held)
            stats.rounds += 1
        return stats

    def _packed(self, bi: int, bucket, device) -> list[torch.Tensor]:
        """The bucket's full tensors as views of its broadcast buffer (destination dtype)."""
        nbytes = [t.src.numel * t.dst.itemsize for t in bucket]
        buf = self._buffer(bi, "bcast", numel=sum(nbytes), dtype=torch.uint8, device=device)
        out, pos = [], 0
        for t, n in zip(bucket, nbytes):
            out.append(buf[pos:pos + n].view(self.dtypes[t.name]).view(t.src.shape))
            pos += n
        return out

    def _gather(self, bi: int, bucket, src, gather: Comm | None, root: int, slots, device, stats,
                into: list[torch.Tensor] | None):
        """All-gather the bucket's shards over one replica of the source; the root
        rebuilds the full tensors, straight into the broadcast buffer (``into``) where
        no cast is needed."""
        if gather is None:
            locals_by_slot = {slots[0]: [src[t.name] for t in bucket]}
        else:
            locals_by_slot = self._all_gather(bi, bucket, src, gather, slots, device, stats)
        if self.rank != root:
            return None
        fulls = [into[i] if into is not None and into[i].dtype == src[t.name].dtype else
                 self._buffer(bi, "full", i, numel=t.src.numel, dtype=src[t.name].dtype,
                              device=device).view(t.src.shape) for i, t in enumerate(bucket)]
        for slot, tensors in locals_by_slot.items():
            for t, full, local in zip(bucket, fulls, tensors):
                for p in t.src.view_of_slot(slot).pieces:
                    full[box_slices(p.offset, p.size)] = local[box_slices(p.local_offset, p.size)]
        return fulls

    def _all_gather(self, bi: int, bucket, src, gather: Comm, slots, device, stats):
        sizes = [[_nbytes(t.src.view_of_slot(s).local_shape, src[t.name]) for t in bucket]
                 for s in slots]
        longest = max(sum(s) for s in sizes)
        mine = self._buffer(bi, "mine", numel=longest, dtype=torch.uint8, device=device)
        pos = 0
        for t in bucket:
            flat = src[t.name].contiguous().view(-1).view(torch.uint8)
            mine[pos:pos + flat.numel()] = flat
            pos += flat.numel()
        outs = [self._buffer(bi, "out", i, numel=longest, dtype=torch.uint8,
                             device=device) for i in range(len(slots))]
        gather.collective(lambda: gather.pg.allgather([outs], [mine]), [mine, *outs])
        stats.bytes_sent += pos * (len(outs) - 1)
        ranks = bucket[0].src.ranks
        order = sorted(ranks[s] for s in slots)  # subgroup ranks ascend with global ranks
        result = {}
        for i, s in enumerate(slots):
            out = outs[order.index(ranks[s])]
            pos, tensors = 0, []
            for t, n in zip(bucket, sizes[i]):
                shape = t.src.view_of_slot(s).local_shape
                tensors.append(out[pos:pos + n].view(src[t.name].dtype).view(shape))
                pos += n
            result[s] = tensors
        return result

    def _broadcast(self, bi: int, out: list[torch.Tensor], full, bcast: Comm, root: int,
                   stats):
        """Broadcast the packed bucket (``out``: its tensors as views of the buffer)."""
        buf = self._buffers[(bi, "bcast")]
        if full is not None and bcast.rank == root:
            for packed, f in zip(out, full):
                if packed.data_ptr() != f.data_ptr():  # rebuilt apart: a cast
                    packed.copy_(f)
            stats.bytes_sent += buf.numel() * (bcast.size - 1)
            stats.num_messages += 1
        else:
            stats.bytes_received += buf.numel()
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank = root
        bcast.collective(lambda: bcast.pg.broadcast([buf], opts), [buf])
        return out

    def _keep(self, bucket, full, dst) -> None:
        for t, f in zip(bucket, full):
            local = dst[t.name]
            for p in t.dst.view(self.rank).pieces:
                local[box_slices(p.local_offset, p.size)] = f[box_slices(p.offset, p.size)]


def _nbytes(shape, like: torch.Tensor) -> int:
    n = like.element_size()
    for s in shape:
        n *= s
    return n
