"""Run first in every SGLang process of the CPU harness (on its PYTHONPATH, see
``reshard.tools.sglang_cpu``): the two torchvision operator schemas that PyPI's
torchvision, beside CPU torch, cannot register itself ("operator torchvision::nms does
not exist" at import). SGLang imports torchvision at start; nothing here calls them."""

import torch

_lib = torch.library.Library("torchvision", "DEF")
for _op in ("nms", "qnms"):
    _lib.define(f"{_op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
