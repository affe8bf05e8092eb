"""``reshard simulate --changed F``: a sparse refit's row, from the plan's rank pairs with
their bytes scaled to the encoded ones, plus the senders' detection."""

from __future__ import annotations

import pytest

from reshard.errors import ConfigError
from reshard.sim.models import preset
from reshard.sim.simulate import run_case
from reshard.sim.sparse import DETECT_BYTES_PER_ELEMENT, DETECT_GBPS, wire_fraction


def test_wire_fraction_is_the_cheapest_encoding():
    assert wire_fraction(0.01, 2) == pytest.approx(0.03)  # int32 offsets + bf16 values
    assert wire_fraction(0.2, 2) == pytest.approx(1 / 16 + 0.2)  # a bitmap
    assert wire_fraction(0.99, 2) == 1.0 and wire_fraction(0.0, 4) == 0.0  # dense; nothing
    with pytest.raises(ConfigError, match=r"changed must be a fraction in \[0, 1\], got 1.5"):
        wire_fraction(1.5, 2)


def _case(changed, dst_dtype="bfloat16"):
    return run_case(preset("llama-3.1-8b", dtype="float32"), "dp8", "tp8", "dgx-h100",
                    dst_dtype=dst_dtype, methods=("p2p",), changed=changed)["sim"]


def test_sparse_row_scales_the_p2p_bytes_and_adds_detection():
    sim = _case(0.01)
    dense, sparse = sim.predictions["p2p"], sim.predictions["sparse"]
    assert sparse.loads.network_bytes == pytest.approx(0.03 * dense.loads.network_bytes)
    # every bf16 value of the model leaves one of the 8 trainer ranks, 1/8 each
    elements = dense.loads.network_bytes / 2 / 8
    assert sparse.stages["detect"] == pytest.approx(
        elements * DETECT_BYTES_PER_ELEMENT / (DETECT_GBPS * 1e9), rel=0.01)
    assert sparse.seconds < 0.35 * dense.seconds
    everything = _case(1.0).predictions
    assert everything["sparse"].loads.network_bytes == everything["p2p"].loads.network_bytes
    assert everything["sparse"].seconds > everything["p2p"].seconds  # detection on top


def test_fp8_engines_are_refused():
    with pytest.raises(ConfigError, match="--changed models one engine dtype, not FP8"):
        _case(0.01, dst_dtype="float8_e4m3fn")
