"""Stable integer seeds derived from several integers (the same in every process and machine)."""

from __future__ import annotations

import hashlib
import struct


def stable_seed(*parts: int) -> int:
    """A 63-bit seed from integers, via BLAKE2b; unlike ``hash()`` it ignores PYTHONHASHSEED."""
    data = b"".join(struct.pack("<q", int(p)) for p in parts)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1
