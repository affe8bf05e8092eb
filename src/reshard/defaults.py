"""The few constants every layer agrees on, defined once (no torch here)."""

from __future__ import annotations

__all__ = ["ALL_METHODS", "CHECKSUMS", "COLOCATED", "DEFAULT_BUDGET_BYTES", "METHODS",
           "SIM_METHODS"]

#: The ways to carry out a plan: ``reshard`` (domain-aware: each byte crosses the network
#: once per fast domain), ``p2p`` (the plan's transfers sent directly) and
#: ``gather_broadcast`` (the conventional path the others are measured against).
METHODS = ("reshard", "p2p", "gather_broadcast")

#: Ranks on one machine reading each other's tensors in place through shared memory
#: (no network path, so the cluster simulator does not model it).
COLOCATED = "colocated"

#: Every method an executor runs.
ALL_METHODS = (*METHODS, COLOCATED)

#: What the cluster simulator predicts: the network methods, plus NeMo RL's own refit
#: (``nemo_broadcast``: its packed broadcast over every trainer and inference rank;
#: ``nemo_hybrid``: FFN weights shard to shard, the rest broadcast), modelled only.
SIM_METHODS = (*METHODS, "nemo_broadcast", "nemo_hybrid")

#: The staging memory one rank uses per round, unless told otherwise.
DEFAULT_BUDGET_BYTES = 256 << 20

#: Message digests the executor can check (``checksum="sum"``, ``"crc32"``, or
#: ``"hmac"``: keyed, with a meeting's token).
CHECKSUMS = ("sum", "crc32", "hmac")
