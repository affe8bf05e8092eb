"""The plan of a peer bootstrap (``reshard.refit.bootstrap.bootstrap_plan``), without
processes: live replicas of other splits (TP2 rows, TP1 whole, TP4 columns) as replicas
of one source into a new replica of yet another layout, exact and spread over the peers;
the refusals, each naming what is wrong."""

from __future__ import annotations

import pytest

import reshard as R
from reshard.defaults import NO_VERSION
from reshard.errors import PlanError
from reshard.local import execute_local
from reshard.refit.bootstrap import PeerInfo, bootstrap_plan, peer_offsets
from reshard.tools.synthetic import fill_local, matches

SHAPES = {"w": (24, 16), "b": (24,)}


def layouts(tp: int, dim: int, dtype: str = "bfloat16") -> dict[str, R.Layout]:
    mesh = R.Mesh(list(range(tp)))
    return {"w": R.Layout(SHAPES["w"], mesh, [R.Shard(dim)], dtype),
            "b": R.Layout(SHAPES["b"], mesh, [R.Replicate()], dtype)}


def peers(*splits: tuple[int, int], version: int = 5) -> list[PeerInfo]:
    return [PeerInfo(tp, layouts(tp, dim), version) for tp, dim in splits]


@pytest.mark.parametrize("splits,new", [
    (((2, 0), (1, 0)), (2, 1)),  # TP2 rows + TP1 -> TP2 columns
    (((4, 1), (2, 0), (1, 0)), (3, 0)),  # three peers, uneven TP3 rows
    (((1, 0), (1, 0)), (1, 0)),  # same layout everywhere
])
def test_new_replica_gets_exactly_its_shards_from_several_peers(splits, new):
    lent = peers(*splits)
    the_plan = bootstrap_plan(lent, layouts(*new))
    src = {}
    for p, offset in zip(lent, peer_offsets(lent)):
        for r in range(p.tp_size):
            src[offset + r] = {n: fill_local(lay, r, salt=5) for n, lay in p.layouts.items()}
    out = execute_local(the_plan, src)
    total = sum(p.tp_size for p in lent)
    mine = layouts(*new)
    for r in range(new[0]):
        assert all(matches(lay, r, out[total + r][n], salt=5) for n, lay in mine.items())
    senders = {tr.src_rank for tr in the_plan.transfers() if tr.src_rank != tr.dst_rank}
    by_peer = {i for i, o in enumerate(peer_offsets(lent)) for s in senders
               if o <= s < o + lent[i].tp_size}
    assert by_peer == set(range(len(lent)))  # every peer lends a share


@pytest.mark.parametrize("lent,mine,message", [
    (peers((1, 0)) + peers((1, 0), version=4), layouts(1, 0),
     r"the peers hold different versions \[5, 4\]; a bootstrap copies one version"),
    ([PeerInfo(1, {}, 3, "its last refit did not commit")], layouts(1, 0),
     r"peer 0 cannot lend: its last refit did not commit"),
    (peers((1, 0), version=NO_VERSION), layouts(1, 0),
     r"peer 0 holds no committed version \(version -1\)"),
    (peers((1, 0)), {"w": layouts(1, 0)["w"]},
     r"the new replica's tensors differ from the peers': missing \['b'\]"),
    (peers((1, 0)), layouts(2, 0, "float32"),
     r"tensor 'w': the new replica wants \[24, 16\] float32, the peers hold \[24, 16\] "
     r"bfloat16"),
])
def test_refusals_name_what_is_wrong(lent, mine, message):
    with pytest.raises(PlanError, match=message):
        bootstrap_plan(lent, mine)
