"""NeMo RL's own refit methods in the cost model, so its published figures can stand
beside predictions of the same methods.

* ``nemo_broadcast`` — NeMo RL's packed broadcast as it runs it (``nemo_rl/utils/
  packed_tensor.py``, ``megatron_policy_worker.broadcast_weights_for_collective``):
  Megatron-Bridge's export brings every full tensor to trainer rank 0 (the *export*
  stage), which broadcasts packed buffers over ``model_update_group``, a NCCL group of
  **every** trainer rank and every inference rank. The broadcast is NCCL's pipelined
  ring over that group, visiting each domain once; because the root's domain holds
  trainer ranks with their own NICs, the ring leaves it through all of them (one channel
  per NIC), not through the root's NIC alone. Two buffers alternate
  (``NRL_REFIT_NUM_BUFFERS=2``), so a buffer's export overlaps the previous buffer's
  broadcast.
* ``nemo_hybrid`` — NeMo RL's ``nccl_reshard`` refit (docs/design-docs/
  nccl-reshard-refit.md): the FFN projection weights (:func:`is_bulk`) go shard to shard
  first (modelled as reshard's domain-aware path, what NCCL M2N's hierarchical reshard
  does), then every other weight through the packed broadcast above.

Stated assumptions of the export stage: each distinct shard of a tensor travels from one
holder (a replica in the root's domain when there is one) to the root; a shard from
another domain enters the root's domain spread evenly over that domain's NICs in the
group (Megatron-Bridge's pipeline broadcast lands it on the root stage's rank of the
same coordinates, whose NIC it uses), then reaches the root over the fast links. The
stage lasts as long as its most loaded link. Megatron-Bridge also all-gathers every
tensor on every other stage (expert all-gathers cross nodes when an expert-parallel
group spans two), and its export loop and packing run tensor by tensor; none of that
is counted, so the export is a lower estimate.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from math import ceil, prod

import numpy as np

from reshard.sim.links import LinkLoads, Net, Prediction, ring, ring_fill
from reshard.stats import distinct_shard_slots

__all__ = ["NEMO_BUFFER_MAX_BYTES", "NEMO_BUFFER_MEMORY_RATIO", "broadcast_prediction",
           "buffer_bytes", "hybrid_prediction", "is_bulk", "split_bulk"]

#: NeMo RL's packed buffer: ``NRL_REFIT_BUFFER_MEMORY_RATIO`` (0.02) of the GPU's memory,
#: at most 5 GiB (``get_target_packed_tensor_size`` in nemo_rl/utils/packed_tensor.py).
NEMO_BUFFER_MEMORY_RATIO = 0.02
NEMO_BUFFER_MAX_BYTES = 5 << 30

#: The weights NeMo RL's nccl_reshard path moves shard to shard (``is_nccl_reshard_param``):
#: the gate / up / down projections of dense MLPs and of routed experts. Shared experts
#: (``shared_experts`` / ``shared_expert``), attention, norms, routers and embeddings
#: stay on the packed broadcast.
_BULK = re.compile(r"\.mlp\.(?:experts\.\d+\.)?(?:gate_proj|up_proj|down_proj)\.weight$")


def is_bulk(name: str) -> bool:
    """Whether NeMo RL's hybrid sends weight ``name`` (a Hugging Face name) shard to shard."""
    return _BULK.search(name) is not None


def split_bulk(tensors: Sequence) -> tuple[list, list]:
    """(bulk, misc): the plan's tensors that NeMo RL reshards, and the rest."""
    bulk, misc = [], []
    for t in tensors:
        (bulk if is_bulk(t.name) else misc).append(t)
    return bulk, misc


def buffer_bytes(net: Net, fallback: int) -> int:
    """NeMo RL's packed buffer on this cluster (``fallback`` when its GPU memory is unknown)."""
    memory = net.cluster.gpu_memory_gb
    if memory is None:
        return fallback
    return int(min(memory * 1e9 * NEMO_BUFFER_MEMORY_RATIO, NEMO_BUFFER_MAX_BYTES))


def _full_bytes(t) -> int:
    """What the broadcast carries for one tensor: all of it, in the engine's dtype."""
    return t.src.numel * t.dst.itemsize


def _chain(group: Sequence[int], root: int, net: Net) -> list[int]:
    """NCCL's ring from ``root``: its own domain first, then each other domain in turn."""
    dom = net.domain
    rest = sorted(set(group) - {root}, key=lambda r: (dom[r] != dom[root], dom[r], r))
    return [root, *rest]


def _export_loads(tensors: Sequence, root: int, group: Sequence[int], net: Net) -> LinkLoads:
    """Link loads of bringing every tensor's distinct shards to ``root`` (see module doc)."""
    dom, nic = net.domain, net.nic
    home = [k for k in sorted({nic[r] for r in group if dom[r] == dom[root]})]
    k = max(net.num_nics, 1)
    nic_out, nic_in = np.zeros(k), np.zeros(k)
    intra_out, intra_in = np.zeros(net.num_ranks), np.zeros(net.num_ranks)
    for t in tensors:
        layout, itemsize = t.src, t.dst.itemsize
        for slot in distinct_shard_slots(layout):
            nbytes = itemsize * prod(layout.view_of_slot(slot).local_shape)
            holder = _nearest_replica(layout, slot, root, net)
            if holder == root or not nbytes:
                continue
            if dom[holder] == dom[root]:
                intra_out[holder] += nbytes
            else:
                nic_out[nic[holder]] += nbytes
                nic_in[home] += nbytes / len(home)
            intra_in[root] += nbytes
    return LinkLoads(nic_out, nic_in, intra_out, intra_in)


def _nearest_replica(layout, slot: int, root: int, net: Net) -> int:
    """The rank holding the shard of ``slot``: the root itself, else a replica in the
    root's domain, else the slot's own rank."""
    pieces = layout.view_of_slot(slot).pieces
    replicas = layout.__dict__.setdefault("_replicas_by_slot", {})
    ranks = replicas.get(slot)
    if ranks is None:
        key = tuple((p.offset, p.size) for p in pieces)
        ranks = replicas[slot] = tuple(
            r for s, r in enumerate(layout.ranks)
            if tuple((p.offset, p.size) for p in layout.view_of_slot(s).pieces) == key)
    if root in ranks:
        return root
    return next((r for r in ranks if net.domain[r] == net.domain[root]), layout.ranks[slot])


def broadcast_prediction(tensors: Sequence, group: Sequence[int], net: Net, bound: float,
                         buffer: int, method: str = "nemo_broadcast") -> Prediction:
    """NeMo RL's packed broadcast of ``tensors`` over ``group`` (every trainer and inference
    rank), rooted at the group's lowest rank, with ``buffer``-byte packed buffers."""
    total = float(sum(_full_bytes(t) for t in tensors))
    if not total or len(group) < 2:
        return Prediction(method, 0.0, "nothing to move", "none", None, bound, {"bytes": total},
                          LinkLoads(*(np.zeros(1),) * 2, *(np.zeros(net.num_ranks),) * 2))
    root = min(group)
    export = _export_loads(tensors, root, group, net)
    t_export, link_e, words_e, rank_e = net.stage(export)
    bw, (kind, words_b, rank_b), links = ring(_chain(group, root, net), False, net, nccl=True)
    num_buffers = ceil(total / buffer)
    fill = net.cluster.op_latency_s + ring_fill(links, net)
    t_bcast = total / bw + num_buffers * fill
    # two alternating buffers: the first export and the last broadcast stand alone
    seconds = max(t_export, t_bcast) + min(t_export, t_bcast) / num_buffers
    if t_bcast >= t_export:
        words, link, rank = f"ring broadcast over {kind}, e.g. {words_b}", "broadcast", rank_b
    else:
        words, link, rank = f"export to rank {root}: {words_e}", link_e, rank_e
    src = np.asarray([a for a, _ in links], dtype=np.int64)
    dst = np.asarray([b for _, b in links], dtype=np.int64)
    bcast = net.loads(src, dst, np.full(len(links), total))
    loads = LinkLoads(*(getattr(export, f) + getattr(bcast, f)
                        for f in ("nic_out", "nic_in", "intra_out", "intra_in")))
    stages = {"export": t_export, "broadcast": total / bw, "ring_fill": num_buffers * fill,
              "buffers": num_buffers, "buffer_bytes": buffer, "ring_gb_per_s": bw / 1e9,
              "bytes": total}
    return Prediction(method, seconds, words, link, rank, bound, stages, loads)


def hybrid_prediction(bulk: Prediction, misc: Prediction, bulk_bytes: float,
                      bound: float) -> Prediction:
    """NeMo RL's hybrid: the bulk reshard, then the misc broadcast (one after the other,
    as ``nccl_reshard_refit`` runs them)."""
    first = bulk if bulk.seconds >= misc.seconds else misc
    what = "bulk reshard" if first is bulk else "misc broadcast"
    misc_bytes = misc.stages.get("bytes", 0.0)
    stages = {"bulk": bulk.seconds, "misc": misc.seconds, "bulk_bytes": bulk_bytes,
              "misc_bytes": misc_bytes,
              "bulk_fraction": bulk_bytes / (bulk_bytes + misc_bytes or 1.0)}
    loads = None
    if bulk.loads is not None and misc.loads is not None:
        loads = LinkLoads(*(_add(getattr(bulk.loads, f), getattr(misc.loads, f))
                            for f in ("nic_out", "nic_in", "intra_out", "intra_in")))
    return Prediction("nemo_hybrid", bulk.seconds + misc.seconds,
                      f"{what}: {first.bottleneck}", first.link, first.rank, bound, stages,
                      loads)


def _add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    n = max(len(a), len(b))
    return np.pad(a, (0, n - len(a))) + np.pad(b, (0, n - len(b)))
