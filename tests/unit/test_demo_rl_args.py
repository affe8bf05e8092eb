"""The RL demo's command line: bad choices are refused by name before anything starts."""

from __future__ import annotations

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
])
def test_bad_choices_are_refused_by_name(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        demo_rl.main(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err
