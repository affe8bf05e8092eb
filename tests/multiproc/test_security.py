"""A real refit with a token (gloo trainer ranks and receiver ranks meeting at a gated
store) while a hostile process on the same machine attacks the store's port: a wrong
token, none, a replayed handshake, garbage, stalled connections and a flood. Every
refit lands exact with keyed digests; the attacker gets in nowhere and reads nothing.
Jobs holding different tokens fail on every rank with a clear message, nothing moved.
See docs/security.md."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from contextlib import suppress
from datetime import timedelta

import pytest
import torch.distributed as dist
from _refit_world import T, holds, make_side, set_version  # tests/multiproc is on sys.path

import reshard as R
from reshard.gate import MAGIC, MAX_PENDING, NONCE, Key, authenticate
from reshard.tools.launch import free_port, run_processes

pytestmark = pytest.mark.multiproc
TOKEN = "multiproc-test-token-0123456789"
VERSIONS = 4


def _job(rank, _world, port, token, pause, rounds=None):
    try:
        side, tensors, layouts, r = make_side(rank, port, token=token,
                                              connect_timeout=timedelta(seconds=8))
    except R.ReshardError as e:
        return {"error": type(e).__name__, "message": str(e)}
    log = {"checksum": [ex.checksum for ex in side.executors], "exact": []}
    for version in range(1, VERSIONS + 1):
        if rounds is not None and version == VERSIONS:  # the attacks ran meanwhile, however
            deadline = time.monotonic() + 60  # fast or slow this host: 2 rounds at least
            while rounds.value < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        if rank < T:
            set_version(tensors, layouts, r, version)
            side.refit(version)
        else:
            side.refit()
            log["exact"].append(holds(tensors, layouts, r, version))
        time.sleep(pause)  # the attacks go on between and during refits
    if rank == 0:
        door = side.comm.store.door
        log.update(refused=door.refused, accepted=door.accepted)
    return log


class Attacker:
    """Attacks ``port`` until ``stop`` is set; records what each attack saw. It runs in
    a process of its own, started before the jobs (a thread would be copied, mid-call,
    into the jobs' forked processes)."""

    def __init__(self, port: int, stop: mp.Event, rounds: mp.Value) -> None:
        self.port, self.stop, self.rounds = port, stop, rounds
        self.seen: dict[str, list] = {k: [] for k in ("wrong", "none", "replay", "garbage",
                                                       "stall", "flood")}
        self.heard = b""  # every byte the gate sent the attacker

    @classmethod
    def main(cls, port: int, stop: mp.Event, out: mp.Queue, rounds: mp.Value) -> None:
        attacker = cls(port, stop, rounds)
        attacker.run()
        out.put((attacker.seen, attacker.heard))

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        sock.settimeout(10)
        return sock

    def _until_closed(self, sock: socket.socket) -> bytes:
        got = b""
        try:
            while chunk := sock.recv(4096):
                got += chunk
        except OSError:
            pass
        sock.close()
        self.heard += got
        return got

    def run(self) -> None:
        while True:  # the gate comes up when trainer rank 0 does
            try:
                self._connect().close()
                break
            except OSError:
                time.sleep(0.05)
        flood = [self._connect() for _ in range(200)]  # held open all along
        stalled = self._connect()  # says nothing at all
        while not self.stop.is_set():
            try:
                self._round()
            except OSError:  # the jobs ended and took the gate with them
                break
            with self.rounds.get_lock():
                self.rounds.value += 1
        self.seen["stall"].append(self._until_closed(stalled))
        self.seen["flood"] = [self._until_closed(s) for s in flood]

    def _round(self) -> None:
        try:
            authenticate(self._connect(), Key("not-the-token-0123456789"), "attack")
            self.seen["wrong"].append("got in")
        except R.AuthError as e:
            self.seen["wrong"].append(str(e))
        except OSError as e:  # a flood of our own may push this one out first
            self.seen["wrong"].append(f"dropped: {e}")
        if not self.seen["none"]:  # torch's client retries for its timeout: once
            self._plain_store()
        self.seen["replay"].append(self._replay())
        sock = self._connect()
        with suppress(OSError):  # closed by the gate midway: what it sent first is read
            sock.sendall(os.urandom(1 << 16))
        self.seen["garbage"].append(self._until_closed(sock))
        time.sleep(0.05)

    def _plain_store(self) -> None:
        """torch's own store client, no token: tries to write and to read."""
        try:
            plain = dist.TCPStore("127.0.0.1", self.port, None, is_master=False,
                                  timeout=timedelta(seconds=1), wait_for_workers=False)
            plain.set("reshard/layouts/inference", b"forged")
            self.seen["none"].append(plain.get("reshard/layouts/trainer"))
        except RuntimeError as e:
            self.seen["none"].append(str(e).splitlines()[0])

    def _replay(self) -> bytes:
        """A handshake recorded from a (here: made up) earlier connection, replayed."""
        sock = self._connect()
        banner = sock.recv(len(MAGIC) + NONCE, socket.MSG_WAITALL)
        old_nonce = os.urandom(NONCE)
        sock.sendall(MAGIC + old_nonce + Key(TOKEN).mac(b"client", os.urandom(NONCE),
                                                         old_nonce))
        return banner + self._until_closed(sock)


def test_hostile_client_during_a_real_refit_gets_nothing_and_every_refit_lands_exact():
    port = free_port()
    ctx = mp.get_context("fork")
    stop, out, rounds = ctx.Event(), ctx.Queue(), ctx.Value("i", 0)
    attacker = ctx.Process(target=Attacker.main, args=(port, stop, out, rounds), daemon=True)
    attacker.start()
    try:
        logs = run_processes(_job, 2 * T, port, TOKEN, 0.5, rounds, init=False, timeout=150)
    finally:
        stop.set()
    seen, heard = out.get(timeout=120)
    attacker.join(timeout=10)
    for log in logs:
        assert log["checksum"] == ["hmac"], log  # keyed digests, on by default with a token
    for log in logs[T:]:
        assert log["exact"] == [True] * VERSIONS, log
    rounds = len(seen["replay"])
    assert rounds >= 2, seen  # the attacks ran through the meeting and the refits
    assert all("refused this rank's token" in w or w.startswith("dropped")
               for w in seen["wrong"]), seen["wrong"]
    assert any("refused this rank's token" in w for w in seen["wrong"]), seen["wrong"]
    assert len(seen["none"]) == 1 and all(isinstance(n, str) for n in seen["none"]), seen

    for got in seen["replay"]:  # banner, a fresh nonce, then "refused"
        assert got[:len(MAGIC)] == MAGIC and got[len(MAGIC) + NONCE:] in (b"\x00", b""), got
    for got in seen["garbage"] + seen["stall"] + seen["flood"]:
        assert len(got) <= len(MAGIC) + NONCE, got  # at most the banner and a nonce
    assert b"embed" not in heard and b"qkv" not in heard
    # by the time rank 0 looked: the flood past the pending cap, one round of attacks
    assert logs[0]["refused"] >= 200 - MAX_PENDING + 3, logs[0]
    assert logs[0]["accepted"] == 2 * T - 1, logs[0]  # one tunnel per other rank


def test_jobs_holding_different_tokens_fail_on_every_rank_and_nothing_moves():
    port = free_port()
    tokens = [TOKEN] * T + ["the-other-jobs-token-0123456789"] * T

    def job(rank, world, port):
        return _job(rank, world, port, tokens[rank], 0)

    logs = run_processes(job, 2 * T, port, init=False, timeout=120)
    for log in logs[T:]:  # the receivers: refused at once, by the gate
        assert log["error"] == "AuthError", log
        assert "refused this rank's token: the two jobs hold different tokens" in \
            log["message"], log
    for log in logs[:T]:  # the trainer: told at once, by the receivers' notice
        assert log["error"] == "AuthError", log
        assert log["message"].startswith("the inference job holds a different token from "
                                         "this job's ($RESHARD_TOKEN or token=): this "
                                         "job's gate refused its ranks"), log
        assert log["message"].endswith("nothing was moved"), log
