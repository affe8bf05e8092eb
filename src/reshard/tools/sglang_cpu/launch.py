"""SGLang servers forked from one process that has already imported SGLang: a measure of
the CPU harness only (nothing of it is in the integration, and nothing an engine computes
changes).

A test starts several SGLang servers on a 2-core host, and SGLang spawns every one of its
processes (``spawn`` start method), so each of them imports torch and SGLang afresh
(6-9 CPU-s each here: about 28 CPU-s of a TP2 server's start), and each scheduler's
first forward runs torch inductor's check of the host's vector ISA (a compile and a
few probe interpreters: about 4 s per process). Here instead:

* :class:`Zygote` is one process (SGLang's CPU environment, ``sglang_env``) that imports
  SGLang's server, scheduler and detokenizer and runs the ISA check once, then forks a
  server for every request. Each child takes the request's arguments, environment,
  directory and log, its own process group, and runs ``sglang.launch_server`` as
  ``python -m`` would.
* In those servers ``spawn`` is ``fork``: the schedulers and the detokenizer share what
  the zygote imported. When the server's process forks them it has run no torch
  computation (no thread pool to inherit) and opened none of the sockets they open.

The test process never imports SGLang (it must not: triton on its path changes torch's
code paths for vLLM); it talks to the zygote over a pipe, and watches a forked server
through a pidfd (:class:`ForkedServer`), as it would a ``subprocess.Popen``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

#: what every SGLang server process imports: the zygote imports it once
PRELOAD = ("sglang.launch_server", "sglang.srt.entrypoints.http_server",
           "sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager")

_set_start_method = multiprocessing.set_start_method


def _fork_for_spawn(method: str | None, force: bool = False) -> None:
    _set_start_method("fork" if method == "spawn" else method, force=force)


class ForkedServer:
    """A server process forked by the zygote, watched like a ``subprocess.Popen`` (its
    exit is seen through a pidfd; its status is the zygote's to reap: ``returncode``
    is ``-1`` once it has exited)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None
        self._fd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._fd], [], [], 0)[0]:
            self.returncode = -1
            os.close(self._fd)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not select.select([self._fd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(f"SGLang server {self.pid}", timeout)
        return self.poll()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


class Zygote:
    """The process the servers fork from (started at the first :meth:`fork`, ended with
    this process: it exits when its pipe closes)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env, self.proc = env, None
        self._lock = threading.Lock()

    def fork(self, args: Sequence[str], *, env: dict[str, str], log: Path) -> ForkedServer:
        """A server ``python -m sglang.launch_server *args`` with ``env``, its output
        appended to ``log``."""
        with self._lock:
            if self.proc is None or self.proc.poll() is not None:
                self.proc = subprocess.Popen([sys.executable, "-m", __name__], env=self.env,
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             text=True)
            request = {"args": list(args), "env": env, "cwd": os.getcwd(), "log": str(log)}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"the SGLang zygote exited ({self.proc.wait()})")
        return ForkedServer(int(reply))


def _serve(args: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """In a forked child: become the server ``python -m sglang.launch_server`` would."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # its own children are its to reap
    os.setpgid(0, 0)  # its own group, stopped whole (see Server.start)
    null, out = os.open(os.devnull, os.O_RDONLY), os.open(log, os.O_WRONLY | os.O_APPEND
                                                          | os.O_CREAT, 0o644)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = ["sglang.launch_server", *args]
    code = 1
    try:
        runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _main() -> None:
    import importlib

    multiprocessing.set_start_method = _fork_for_spawn
    for name in PRELOAD:
        importlib.import_module(name)
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.pick_vec_isa()  # its answer cached for every scheduler forked below
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the servers reaped by the kernel
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _serve(**request)
        print(pid, flush=True)


if __name__ == "__main__":
    _main()
