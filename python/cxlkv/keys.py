"""LMCache-style object keys, encoded as the L1 tier reference's §2.1
directory string (``/work/shared/spec/l1-tier-reference.md``):

``<model_name>@<kv_rank as 8 lowercase hex digits>@<chunk_hash as lowercase
hex>@<object_group_id in decimal>``, then ``@<cache_salt>`` only when the
salt is non-empty.

Example: model ``m``, rank ``0xABCD``, hash ``00 00 00 01``, group 0, no
salt → ``m@0000abcd@00000001@0``.
"""

from __future__ import annotations

from typing import NamedTuple, Union


class ObjectKey(NamedTuple):
    """The five fields of an LMCache object key (equality covers all)."""

    model_name: str
    kv_rank: int
    #: bytes, bytearray or memoryview (as :func:`object_key` takes).
    chunk_hash: Union[bytes, bytearray, memoryview]
    object_group_id: int = 0
    cache_salt: str = ""

    def __str__(self) -> str:
        # Text fields must be str: str() of bytes or None is text too, and
        # would silently be another key than the one encoded elsewhere.
        for name in ("model_name", "cache_salt"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, not {type(value).__name__}")
        if not isinstance(self.kv_rank, int):
            raise TypeError(f"kv_rank must be an int, not {type(self.kv_rank).__name__}")
        if not 0 <= self.kv_rank <= 0xFFFF_FFFF:
            raise ValueError(f"kv_rank {self.kv_rank} does not fit 8 hex digits")
        if not isinstance(self.chunk_hash, (bytes, bytearray, memoryview)):
            raise TypeError(f"chunk_hash must be bytes, not {type(self.chunk_hash).__name__}")
        if not isinstance(self.object_group_id, int):
            raise TypeError("object_group_id must be an int")
        s = (
            f"{self.model_name}@{self.kv_rank:08x}@{bytes(self.chunk_hash).hex()}"
            f"@{self.object_group_id:d}"
        )
        if self.cache_salt:
            s += f"@{self.cache_salt}"
        return s

    def encode(self) -> bytes:
        """The directory key (UTF-8 of :func:`str`)."""
        return str(self).encode()


def object_key(
    model_name: str,
    kv_rank: int,
    chunk_hash: Union[bytes, bytearray, memoryview],
    object_group_id: int = 0,
    cache_salt: str = "",
) -> str:
    """The §2.1 string of an object key. A field of another type than its
    annotation's raises ``TypeError`` (``bytes`` or ``None`` as the model
    name or salt would format into another key), a rank outside
    0..=0xFFFFFFFF ``ValueError``."""
    return str(ObjectKey(model_name, kv_rank, chunk_hash, object_group_id, cache_salt))
