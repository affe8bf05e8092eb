"""FP8 block quantization of sharded tensors, shard by shard, bit for bit the reference.

* :mod:`reshard.quant.blocks` (torch-free): the block grid, which blocks each source
  touches and which are split across sources (:func:`plan_fp8`), bytes, and the engine
  splits vLLM refuses;
* :mod:`reshard.quant.fp8`: the reference quantizer and the per-shard steps (partial
  amax, final scales, FP8 codes); :mod:`reshard.refit.amax` runs the amax exchange
  over a process group.
"""

from reshard.quant.blocks import (
    BlockFormat,
    Fp8Bytes,
    Fp8Plan,
    SharedBlock,
    TensorBlocks,
    check_engine_split,
    fp8_bytes,
    plan_fp8,
)
from reshard.quant.fp8 import Fp8Shard, quantize_reference, quantize_shards

__all__ = ["BlockFormat", "Fp8Bytes", "Fp8Plan", "Fp8Shard", "SharedBlock", "TensorBlocks",
           "check_engine_split", "fp8_bytes", "plan_fp8", "quantize_reference",
           "quantize_shards"]
