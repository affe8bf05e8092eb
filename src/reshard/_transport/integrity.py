"""Message checksums for the executor's integrity option (``checksum="sum"``,
``"crc32"`` or ``"hmac"``): a digest of every message is sent after it and compared on
arrival. ``"hmac"`` is keyed (HMAC-SHA256 with a key derived from the meeting's token,
over the message's place in the run and its bytes), so nobody without the token can
forge one. See ``docs/reliability.md`` and ``docs/security.md``."""

from __future__ import annotations

import hmac
import zlib

import torch

from reshard.defaults import CHECKSUMS
from reshard.errors import ConfigError

__all__ = ["CHECKSUMS", "digest"]


def digest(buf: torch.Tensor, kind: str = "sum", *, key: bytes | None = None,
           context: bytes = b"") -> int:
    """A message's checksum, a function of its bytes alone (not of where they sit).

    ``"sum"``: the wrapping int64 sum of the 8-byte words plus a position-weighted sum of
    512-word block sums (order across blocks counts) and of the trailing bytes; one pass,
    on the tensor's own device. ``"crc32"``: zlib's CRC-32 (on the host). Any single bit
    flip changes either; only the CRC also sees reorders inside a 4 KiB block.
    ``"hmac"``: HMAC-SHA256 under ``key`` of ``context`` and the bytes, its first 8 bytes
    (on the host)."""
    if kind == "hmac":
        if key is None:
            raise ConfigError("checksum 'hmac' needs a key (a meeting with a token)")
        data = buf.detach().reshape(-1).view(torch.uint8).cpu()
        h = hmac.new(key, context + b"|", "sha256")
        h.update(memoryview(data.numpy()))
        return int.from_bytes(h.digest()[:8], "little", signed=True)
    if kind == "crc32":
        data = buf.detach().reshape(-1).view(torch.uint8)
        return zlib.crc32(data.cpu().numpy()) if data.numel() else 0
    if kind != "sum":
        raise ConfigError(f"unknown checksum {kind!r}; expected one of {CHECKSUMS}")
    data = buf.detach().reshape(-1).view(torch.uint8)
    n = data.numel()
    head = n - n % 8
    body = data[:head]
    if body.storage_offset() % 8:  # an int64 view needs an 8-byte aligned start (even empty)
        body = body.clone()
    words = body.view(torch.int64)
    m = head // 8 // 512 * 512
    blocks = words[:m].view(-1, 512).sum(1)
    weights = torch.arange(1, blocks.numel() + 1, dtype=torch.int64, device=data.device)
    tail = data[head:].to(torch.int64)
    tail_w = torch.arange(1, tail.numel() + 1, dtype=torch.int64, device=data.device)
    total, pos, rest = torch.stack([blocks.sum() + words[m:].sum(), (blocks * weights).sum(),
                                    (tail * tail_w * 257).sum()]).tolist()
    d = (total + pos * 0x9E3779B97F4A7C15 + rest * 0xC2B2AE3D27D4EB4F + n) % (1 << 64)
    return d - (1 << 64) if d >= 1 << 63 else d
