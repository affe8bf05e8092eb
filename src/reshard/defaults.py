"""The few constants every layer agrees on, defined once (no torch here)."""

from __future__ import annotations

__all__ = ["ALL_METHODS", "CHECKSUMS", "COLOCATED", "DEFAULT_BUDGET_BYTES",
           "DEFAULT_REFIT_BUDGET_BYTES", "DEFAULT_REFIT_STAGING_BYTES", "METHODS",
           "NO_VERSION", "SIM_METHODS"]

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

#: The same for a refit (``RefitSender``, ``RefitReceiver``, the elastic and vLLM sides):
#: smaller, since a refit lands beside a serving engine (memory its KV cache wants) and a
#: trainer's own state, and the messages that cannot land in place wait in an arena of
#: up to this size on the receiving rank. Measured with ``benchmarks/refit_real.py
#: --budget-mib`` (FSDP2 on 2 ranks into vLLM CPU TP2, 2026-12-03): the Qwen3-MoE 1.38B
#: shape's engine rank peak extra 1.07x its shard against 1.17x at 256 MiB, trainer rank
#: 0's 66 MB against 263 MB, in 1.73-2.07 s against 2.02 s; dense models as fast within
#: the host's run-to-run spread (Qwen2.5-1.5B 1.94-2.03 s at 32, 64 and 256 MiB). At 32
#: MiB trainer rank 0 went 2.6 MB (its fixed extra) over its budget: hence 64.
DEFAULT_REFIT_BUDGET_BYTES = 64 << 20

#: What a refit's round may stage on a receiving rank (its arena), within the budget:
#: the regions that cannot land in place (several small tensors packed into one
#: message; a region strided in the receiver's tensor, such as an engine rank's gate or
#: up rows of a run of fused experts) are cut into parts that lie contiguous there and
#: arrive in place, alone in their message (:data:`reshard.schedule.SOLO_MIN_BYTES` and
#: up), the rest into more rounds. Measured with ``benchmarks/refit_real.py --models
#: qwen3-moe-0.8b`` (2026-12-03): the engine ranks' arena 64 KB against 38 MB without
#: the cap, their peak extra 1.00-1.01x the shard against 1.06x, trainer rank 0's 40 MB
#: against 67 MB, the refit 1.15 s against 1.24 s (the cap alone, no in-place parts:
#: 6 MB, 1.02x, 1.34 s; at the four real sizes: docs/results.md).
DEFAULT_REFIT_STAGING_BYTES = 8 << 20

#: The freed heap a refit's commit on vLLM CPU may keep resident before it hands it back
#: to the system (``malloc_trim``; :class:`reshard.integrations.vllm.memory.HeapBound`),
#: and with it about the most a commit's peak rises above the buffers. Pages handed back
#: are faulted in again by the next packed copies, which a host pays for: on this 2-core
#: VM 512 MB of first touches cost about 0.2 s against 0.03 s to rewrite them. ``None``
#: (``heap_slack_bytes=None`` at ``reshard_init``) keeps every freed page for the next
#: copies to reuse, at the cost of the heap's fragmentation held resident. Measured with
#: ``benchmarks/refit_real.py --heap-slack-mib`` (2026-12-03, FSDP2 on 2 ranks into vLLM
#: CPU TP2, two alternating pairs at Qwen2.5-1.5B): 8 MiB: 730k page faults a refit on
#: the engine ranks, 2.39-3.33 s of their CPU, peak extra 1.008x the shard; never
#: trimmed: 121-131k (mostly the LM head's packed copy, which glibc maps afresh),
#: 1.97-2.56 s, 1.11-1.21x. The refit's time moved within the host's spread (1.86 /
#: 2.61 s against 2.01 / 2.27 s): the memory target keeps the default.
DEFAULT_COMMIT_HEAP_SLACK_BYTES = 8 << 20

#: The weight version of weights no refit brought: a fresh engine's (loaded from its
#: checkpoint), a trainer's that sent nothing yet. A refit's version is the trainer's
#: step (0 for the weights it syncs before its first optimizer step), so every real
#: version is newer; a sparse refit never counts it as a base (the first refit into an
#: unversioned engine is dense).
NO_VERSION = -1

#: Message digests the executor can check (``checksum="sum"``, ``"crc32"``, or
#: ``"hmac"``: keyed, with a meeting's token).
CHECKSUMS = ("sum", "crc32", "hmac")

#: A trainer's sparse-refit mode unless it asks otherwise (``docs/sparse.md``): after the
#: first refit only the engine-dtype values that changed travel, where that pays in
#: bytes, in time and in memory (``reshard.refit.sparse``: ``AUTO_*``); dense elsewhere.
#: ``"on"`` always (after the first), ``"off"`` never (no copy kept).
DEFAULT_SPARSE = "auto"
