"""The RL demo's command line: bad choices are refused by name before anything starts;
the demos' output is quiet unless ``--verbose`` or ``RESHARD_VERBOSE=1``."""

from __future__ import annotations

import os

import pytest

from reshard.tools import demo_rl


@pytest.mark.parametrize("spec, sizes", [("tp2", (2, 1, 1)), ("pp2", (1, 2, 1)),
                                         ("tp2,pp2", (2, 2, 1)), ("tp1,dp2", (1, 1, 2))])
def test_parallel_specs_give_the_megatron_sizes(spec, sizes):
    p = demo_rl.parse_parallel(spec)
    assert (p.tp, p.pp, p.dp) == sizes and p.world_size == sizes[0] * sizes[1] * sizes[2]


@pytest.mark.parametrize("argv, says", [
    (["--trainer", "megatron", "--parallel", "ep2"], "expert parallelism"),
    (["--trainer", "megatron", "--parallel", "fsdp2"], "dense model with tp, pp and dp"),
    (["--trainer", "megatron", "--parallel", "tq2"], "bad parallel spec"),
    (["--trainer", "megatron", "--parallel", "tp4,pp4"], "at most 8"),
    (["--parallel", "tp2"], "--parallel is for --trainer megatron"),
    (["--trainer", "megatron", "--launcher", "ray"], "FSDP2 trainer only"),
    (["--serve", "--launcher", "ray"], "--serve runs the FSDP2 trainer with the local"),
])
def test_bad_choices_are_refused_by_name(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        demo_rl.main(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_the_demos_quiet_their_libraries_unless_asked_or_already_set(monkeypatch):
    from reshard.tools import rl_task

    _unset(monkeypatch, *rl_task.QUIET_ENV, "PYTHONWARNINGS", "RESHARD_VERBOSE")
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")  # the user's own choice stays
    monkeypatch.setenv("PYTHONWARNINGS", "error::DeprecationWarning")
    assert not rl_task.verbose_requested()
    rl_task.quiet_env(False)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    assert os.environ["TORCH_LOGS"] == "-torch"
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "info"
    filters = os.environ["PYTHONWARNINGS"].split(",")
    assert filters == ["error::DeprecationWarning", *rl_task.QUIET_WARNINGS]
    rl_task.quiet_env(False)  # twice: the same filters, not doubled
    assert os.environ["PYTHONWARNINGS"].split(",") == filters


@pytest.mark.parametrize("flag, env, expected", [(True, None, True), (False, "1", True),
                                                 (False, "0", False), (False, "", False)])
def test_verbose_shows_every_log(flag, env, expected, monkeypatch):
    from reshard.tools import rl_task

    _unset(monkeypatch, *rl_task.QUIET_ENV, "PYTHONWARNINGS", "RESHARD_VERBOSE")
    if env is not None:
        monkeypatch.setenv("RESHARD_VERBOSE", env)
    assert rl_task.verbose_requested(flag) is expected
    rl_task.quiet_env(rl_task.verbose_requested(flag))
    assert os.environ["VLLM_LOGGING_LEVEL"] == ("INFO" if expected else "ERROR")
    assert ("TORCH_LOGS" in os.environ) is not expected
    # the demo's own child processes (trainer ranks) read the choice from the environment
    assert rl_task.verbose_requested() is expected


def _unset(monkeypatch, *names):
    """Unset ``names`` for this test; whatever the test sets is undone after it."""
    for name in names:
        monkeypatch.setenv(name, "")  # recorded, so restored (or removed) afterwards
        monkeypatch.delenv(name)
