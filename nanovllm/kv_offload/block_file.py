"""One block's file: MAGIC, the header's length (u32), the header (JSON: the fingerprint, the KV group,
the block's chained hash, its parent's and its token ids, the payload's length), the payload (the
block's K/V bytes as the cache holds them), then xxh64 of everything before it (u64). A file is
trusted only when its length, magic, checksum and every header field match what the reader asked for.
"""
import json
import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"NVKVBLK1"
_LEN = struct.Struct("<I")
_SUM = struct.Struct("<Q")


class BadBlockFile(ValueError):
    """A block file that is truncated, corrupted, or holds another block (or another model's)."""


@dataclass(frozen=True)
class BlockKey:
    """What a block holds: the tokens of one full block after a chained parent, in one KV group."""

    group: int
    hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"{self.group}-{self.hash:016x}.kvb"


def _header(fingerprint: str, key: BlockKey, payload_len: int) -> bytes:
    return json.dumps({"fingerprint": fingerprint, "group": key.group, "hash": key.hash,
                       "parent_hash": key.parent_hash, "token_ids": list(key.token_ids),
                       "payload_len": payload_len}, separators=(",", ":")).encode()


def encode(fingerprint: str, key: BlockKey, payload: memoryview) -> list[bytes | memoryview]:
    """The file's pieces, in order (written one after another, never joined in memory)."""
    header = _header(fingerprint, key, payload.nbytes)
    pieces = [MAGIC, _LEN.pack(len(header)), header, payload]
    digest = xxhash.xxh64()
    for piece in pieces:
        digest.update(piece)
    return pieces + [_SUM.pack(digest.intdigest())]


def decode(data: bytes, fingerprint: str, key: BlockKey, payload_len: int) -> memoryview:
    """The payload of a file read whole; BadBlockFile saying what is wrong with it otherwise."""
    view = memoryview(data)
    start = len(MAGIC) + _LEN.size
    if len(data) < start + _SUM.size or bytes(view[:len(MAGIC)]) != MAGIC:
        raise BadBlockFile(f"not a block file ({len(data)} bytes, no magic)")
    (header_len,) = _LEN.unpack_from(view, len(MAGIC))
    if len(data) != start + header_len + payload_len + _SUM.size:
        raise BadBlockFile(f"{len(data)} bytes where {start + header_len + payload_len + _SUM.size} were "
                           "expected (truncated, or another layout)")
    (stored,) = _SUM.unpack_from(view, len(data) - _SUM.size)
    if xxhash.xxh64(view[:len(data) - _SUM.size]).intdigest() != stored:
        raise BadBlockFile("checksum mismatch (corrupted)")
    try:
        header = json.loads(bytes(view[start:start + header_len]))
    except ValueError as e:
        raise BadBlockFile(f"unreadable header: {e}") from None
    expected = json.loads(_header(fingerprint, key, payload_len))
    if header != expected:
        wrong = sorted(k for k in expected if header.get(k) != expected[k]) if isinstance(header, dict) else ["all"]
        raise BadBlockFile(f"holds another block (differs in {', '.join(wrong)})")
    return view[start + header_len: start + header_len + payload_len]
