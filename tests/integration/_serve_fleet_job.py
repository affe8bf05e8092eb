"""One rank of the trainer job that feeds two live servers as one fleet
(tests/integration/test_vllm_serve.py, its last step)::

    python _serve_fleet_job.py --rank R --world 2 --dist-port P OUT MEET_PORT \\
        --versions 4:step2,5:step3 --replicas 2

Each rank loads the first checkpoint named (``OUT/step2``: float32, sharded with FSDP2)
and hosts the fleet at ``MEET_PORT`` (an ``ElasticSender`` each: relayed fan-out,
``sparse="on"``, the meeting's token from ``$SERVE_TEST_TOKEN``); rank 0 says
``OUT/fleet-up`` and waits for ``--replicas`` servers to ask to join (through vLLM's
weight-transfer protocol, ``replica`` in their init info). For each ``version:checkpoint``:
the ranks load that checkpoint's values into their shards (the first is loaded already),
say ``OUT/fleet-ready{version}``, wait for ``OUT/fleet-go{version}`` (the servers are
receiving, clients generating) and refit the fleet; each rank writes
``OUT/fleet{version}-{rank}.json`` (its bytes sent, whether sparse, the members, the
fan-out). A version re-sends a step the test has a fresh engine's answers for, as a
trainer rolled back or re-admitted would.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from _serve_trainer_job import wait_for  # the forkserver imported its vLLM client once

from reshard.integrations import hf
from reshard.refit import ElasticSender


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("meet_port", type=int)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dist-port", type=int, required=True)
    ap.add_argument("--versions", required=True)
    ap.add_argument("--replicas", type=int, default=2)
    a = ap.parse_args()
    out = Path(a.out)
    versions = [(int(v), out / ckpt) for v, ckpt in
                (item.split(":") for item in a.versions.split(","))]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.dist_port))
    torch.set_num_threads(1)  # two ranks on a 2-core host, beside two servers
    dist.init_process_group("gloo", rank=a.rank, world_size=a.world)
    model = hf.load_model(versions[0][1], torch.float32)
    hf.shard_fsdp2(model)
    params, layouts = hf.refit_params(model)
    elastic = ElasticSender(params, layouts, host="127.0.0.1", port=a.meet_port,
                            rank=a.rank, trainer_size=a.world,
                            timeout=timedelta(seconds=120), fanout="relay", sparse="on",
                            token=os.environ["SERVE_TEST_TOKEN"])
    if a.rank == 0:
        (out / "fleet-up").touch()
        elastic.wait_for_requests(a.replicas)
    for k, (version, ckpt) in enumerate(versions):
        if k:  # that checkpoint's values into this rank's shards, in place
            other = hf.load_model(ckpt, torch.float32)
            hf.shard_fsdp2(other)
            with torch.no_grad():
                for mine, theirs in zip(model.parameters(), other.parameters()):
                    mine.copy_(theirs)
            del other
        dist.barrier()
        if a.rank == 0:
            (out / f"fleet-ready{version}").touch()
        wait_for(out / f"fleet-go{version}")
        try:
            stats = elastic.refit(version)
            result = {"ok": True, "sent": stats.bytes_sent,
                      "sparse": stats.sparse is not None and stats.sparse.used,
                      "members": elastic.history[-1]["members"],
                      "fanout": elastic.side.executors[0].schedule.fanout}
        except Exception as e:  # noqa: BLE001 - reported to the test
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        path = out / f"fleet{version}-{a.rank}.json"
        path.with_suffix(".tmp").write_text(json.dumps(result))
        os.replace(path.with_suffix(".tmp"), path)
        if not result["ok"]:
            break
    elastic.close()
    os._exit(0)


if __name__ == "__main__":
    main()
