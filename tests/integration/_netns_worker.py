"""gloo worker for tests/integration/test_netns.py (run inside an emulated node).

Usage: ``_netns_worker.py RANK WORLD MASTER_ADDR PORT NBYTES REPS OUT_JSON``

Rank 0 sends NBYTES to every other rank REPS times (ping-pong: the peer checks the
bytes and answers with a one-element ok flag) and writes the per-peer timings and
integrity results to OUT_JSON. Other ranks only receive and check.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def _payload(nbytes: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def main() -> None:
    rank, world, addr, port, nbytes, reps = (
        int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]),
        int(sys.argv[5]), int(sys.argv[6]),
    )
    out_path = sys.argv[7]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=40),
    )
    expected = _payload(nbytes)
    ack = torch.zeros(1, dtype=torch.int64)
    warm = torch.zeros(1024, dtype=torch.uint8)
    results: dict[str, dict[str, list[float] | list[bool]]] = {}
    for peer in range(1, world):
        if rank == 0:
            dist.send(warm, peer)
            dist.recv(ack, peer)
            secs: list[float] = []
            oks: list[bool] = []
            for _ in range(reps):
                t0 = time.perf_counter()
                dist.send(expected, peer)
                dist.recv(ack, peer)
                secs.append(time.perf_counter() - t0)
                oks.append(bool(ack.item() == 1))
            results[str(peer)] = {"secs": secs, "intact": oks}
        elif rank == peer:
            dist.recv(warm, 0)
            dist.send(ack, 0)
            buf = torch.empty(nbytes, dtype=torch.uint8)
            for _ in range(reps):
                buf.zero_()
                dist.recv(buf, 0)
                ack.fill_(1 if torch.equal(buf, expected) else 0)
                dist.send(ack, 0)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
