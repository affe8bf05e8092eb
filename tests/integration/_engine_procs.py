"""How the tests start and stop vLLM's engine processes: quickly, on a 2-core host.

Three measures of the test harness only (nothing of them is in reshard, and none
changes what an engine or a trainer computes):

* **Workers forked from one forkserver.** vLLM CPU starts its TP workers (and a TP1
  engine's core) with ``spawn``: every one imports torch and vLLM afresh, about 9 s of
  each engine start here on 2 cores. :func:`install` gives vLLM a context whose processes
  fork from one forkserver that imported vLLM once: a TP2 start takes 3-4 s against
  10-17 s (measured 2026-12-05, tiny Llama, bf16). A forkserver's child would inherit the
  forkserver's environment and working directory, not the test's of that moment, so each
  child first takes the parent's as they were when vLLM asked for the process (what
  spawn gives it): every engine still reads its own ``VLLM_CPU_OMP_THREADS_BIND``.
  What a child cannot take from its environment is what torch's libgomp read once, as
  the forkserver loaded it: the OpenMP thread count (``OMP_NUM_THREADS``) that threads
  created later start from. The forkserver therefore starts with the one a vLLM worker
  of these tests is given (one core a rank: ``WORKER_OMP``), whoever starts it first,
  and a child asking another refuses to run (:func:`_run_as_spawned`). Before, it
  started with the environment of the moment: a TP1 engine's core, started first, left
  it with none (OpenMP's default, a thread per core), and the TP2 engines forked after
  it answered a long prefill with other logprobs than the same engine spawned
  (2026-12-07: ``test_vllm_bootstrap.py`` then ``test_vllm_serve.py``).
* **Workers that exit at once.** A vLLM worker's interpreter spends 2-3 s here tearing
  down its modules' objects at exit (its cyclic garbage collection at finalization), and
  under load an engine shutdown ran into vLLM's 5 s grace and SIGTERM. :func:`close` has
  the worker processes of an engine whose core runs in this process (TP2 and up, see
  ``start_llm``) end with ``os._exit`` once they have done their own shutdown (queues,
  process groups): a shutdown takes about 1 s.
* **Trainer jobs forked from the same forkserver.** :func:`start_job` runs a trainer
  job's script as ``python SCRIPT ARGS`` would (its ``__main__``, its ``argv``, its
  folder first on ``sys.path``, its output into files), in a process forked from that
  forkserver, which imported torch, transformers and vLLM already: about 4 s less per
  job here (9 s for a job that imports vLLM's client), each on the critical path of its
  test. The job forks its ranks as it always does; only its interpreter's start differs.
  Only once an engine start has started the forkserver (see :func:`start_job`); before
  that, a job is a fresh interpreter.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

#: what a worker (and a TP1 engine core) imports, and a trainer job: the forkserver
#: imports it once
PRELOAD = ["vllm.v1.executor.multiproc_executor", "vllm.v1.worker.cpu_worker",
           "vllm.v1.engine.core", "reshard.integrations.vllm.worker",
           "reshard.integrations.hf", "reshard.refit", "reshard.tools.launch",
           "vllm.distributed.weight_transfer.clients",
           "vllm.distributed.weight_transfer.factory"]


#: the OpenMP settings the forkserver starts with (vLLM gives each worker of a rank bound
#: to one core ``OMP_NUM_THREADS=1``; every engine of these tests binds one core a rank)
WORKER_OMP = {"OMP_NUM_THREADS": "1"}
#: OpenMP placements the forkserver starts without (vLLM binds each worker's threads
#: itself; a placement read by the forkserver would be some other worker's)
_OMP_PLACEMENTS = ("GOMP_CPU_AFFINITY", "OMP_PLACES", "OMP_PROC_BIND", "KMP_AFFINITY")


def _run_as_spawned(env: dict[str, str], cwd: str, target, args, kwargs):
    for key, value in WORKER_OMP.items():
        if env.get(key, value) != value:
            raise RuntimeError(
                f"a process forked from the tests' forkserver asks {key}={env[key]}, but "
                f"torch's OpenMP runtime in it was set up with {key}={value} (read once, "
                "as the forkserver started): bind one core a rank "
                "(VLLM_CPU_OMP_THREADS_BIND), or change _engine_procs.WORKER_OMP")
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    return target(*args, **kwargs)


class _PreloadedContext:
    """A multiprocessing context for vLLM: forkserver processes that start with the
    parent's environment and directory of the moment, as spawned ones do."""

    def __init__(self) -> None:
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(PRELOAD)

    def Process(self, group=None, target=None, name=None, args=(), kwargs=None,
                *, daemon=None, env: dict[str, str] | None = None):
        """``env``: the child's environment (by default this process's of the moment)."""
        _ensure_forkserver()
        return self._ctx.Process(group=group, target=_run_as_spawned, name=name,
                                 args=(dict(os.environ if env is None else env), os.getcwd(),
                                       target, tuple(args), dict(kwargs or {})),
                                 daemon=daemon)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


_context: _PreloadedContext | None = None


def _ensure_forkserver() -> None:
    """Start the forkserver, if not running, with this process's environment of the
    moment but for OpenMP's: ``WORKER_OMP``, no placements."""
    from multiprocessing import forkserver

    if forkserver_running():
        return
    saved = dict(os.environ)
    try:
        for key in _OMP_PLACEMENTS:
            os.environ.pop(key, None)
        os.environ.update(WORKER_OMP)
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _preloaded() -> _PreloadedContext:
    global _context
    if _context is None:
        _context = _PreloadedContext()
    return _context


def install() -> None:
    """vLLM's engine processes, from here on, fork from the preloaded forkserver."""
    import vllm.v1.engine.utils as engine_utils
    import vllm.v1.executor.multiproc_executor as executor

    context = _preloaded()
    executor.get_mp_context = engine_utils.get_mp_context = lambda: context


def _run_script(script: str, args: list[str], stdout: str, stderr: str) -> None:
    """``script``: a file, or ``-m`` and a module's name, as the interpreter takes them."""
    import runpy
    import sys

    for fd, path in ((1, stdout), (2, stderr)):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, fd)
        os.close(out)
    try:
        if script.startswith("-m "):
            sys.argv = [script[3:], *args]
            runpy.run_module(script[3:], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


class Job:
    """A trainer job's process (:func:`start_job`), asked as a ``subprocess.Popen`` is."""

    def __init__(self, proc) -> None:
        self.proc = proc

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(str(self.proc), timeout)
        return self.proc.exitcode

    def kill(self) -> None:
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join()


def forkserver_running() -> bool:
    """Whether an engine start has started the forkserver (in this process)."""
    from multiprocessing import forkserver

    return _context is not None and forkserver._forkserver._forkserver_address is not None


def start_job(script, args, *, stdout, stderr, env: dict[str, str] | None = None):
    """``python SCRIPT ARGS`` (or ``python -m MODULE ARGS`` for ``script="-m MODULE"``;
    stdout and stderr into those files, ``env`` its whole environment, by default this
    process's): forked from the forkserver if an engine start has started it, else a
    fresh interpreter (``subprocess.Popen``). Never the first to start the forkserver:
    vLLM CPU's engine start sets, in this process's environment, what the forkserver
    reads once at its own start and its engine workers inherit (``LD_PRELOAD`` of
    tcmalloc and torch's libgomp, ``TORCHINDUCTOR_CPP_DYNAMIC_THREADS``, which shapes the
    kernels a compiled engine generates): a forkserver started by a job without them made
    a served engine's fresh twin answer with other logprobs (2026-12-06)."""
    import subprocess
    import sys

    script, args = str(script), [str(a) for a in args]
    if not forkserver_running():
        command = script.split(" ", 1) if script.startswith("-m ") else [script]
        with open(stdout, "ab") as out, open(stderr, "ab") as err:
            return subprocess.Popen([sys.executable, *command, *args], env=env,
                                    stdout=out, stderr=err)
    proc = _preloaded().Process(target=_run_script, env=env,
                                args=(script, args, str(stdout), str(stderr)))
    proc.start()
    return Job(proc)


def close(llm) -> None:
    """Shut ``llm`` down; its engine processes skip the interpreter's teardown."""
    parent = os.getpid()

    def exit_at_once(worker) -> int:  # pickled by value: the workers need not import this
        import atexit

        if os.getpid() != parent:  # never the test process itself
            atexit.register(os._exit, 0)  # the last registered runs first
        return os.getpid()

    try:
        # a function reaches the workers only from an engine core in this process (a
        # TP1 engine's core, a process of its own, takes names only): TP2 and up here
        if type(llm.llm_engine.engine_core).__name__ == "InprocClient":
            llm.collective_rpc(exit_at_once, timeout=30)
    finally:
        llm.llm_engine.engine_core.shutdown()
