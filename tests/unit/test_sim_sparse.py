"""``reshard simulate --changed F``: a sparse refit's row, from the plan's rank pairs with
their bytes scaled to the encoded ones, plus the senders' detection."""

from __future__ import annotations

import numpy as np
import pytest

from reshard.errors import ConfigError
from reshard.sim.models import preset
from reshard.sim.simulate import run_case
from reshard.sim.sparse import DETECT_BYTES_PER_ELEMENT, DETECT_GBPS, detect_bytes, wire_fraction


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


def test_fp8_engines_scale_each_tensor_at_its_own_element_size():
    # an FP8 block engine: codes of one byte (offsets and values: 5 bytes a changed
    # code), float32 scales and the tensors left in bf16 each at their own size
    sim = _case(0.01, dst_dtype="float8_e4m3fn")
    dense, sparse = sim.predictions["p2p"], sim.predictions["sparse"]
    src, dst, nbytes = sim.pairs
    assert 0.03 < sparse.stages["wire_fraction"] < 0.05  # mostly codes: 0.05
    assert sparse.loads.network_bytes == pytest.approx(
        sparse.stages["wire_fraction"] * dense.loads.network_bytes)
    # the same model into bf16: its linear layers twice the bytes (the embedding and the
    # head stay bf16 in both), 0.03 of them
    bf16 = _case(0.01)
    assert dense.loads.network_bytes < 0.8 * bf16.predictions["p2p"].loads.network_bytes
    assert sparse.stages["detect"] < bf16.predictions["sparse"].stages["detect"]
    assert sparse.seconds < 0.35 * dense.seconds


def test_wire_fraction_per_element_size():
    assert wire_fraction(0.01, 1) == pytest.approx(0.05)  # FP8 codes: offsets + values
    assert wire_fraction(0.01, 4) == pytest.approx(0.02)  # float32 scales
    got = wire_fraction(0.01, np.array([1.0, 2.0, 4.0]))
    assert got == pytest.approx([0.05, 0.03, 0.02])
    assert detect_bytes(2) == DETECT_BYTES_PER_ELEMENT == 11 and detect_bytes(1) == 8
