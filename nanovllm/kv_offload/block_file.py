"""One block's file: MAGIC, the header's length (u32), the header (JSON: the fingerprint, the KV group,
the block's chained hash, its parent's and its token ids, the payload's length), the payload (the
block's K/V bytes as the cache holds them), then xxh3-64 of everything before it (u64). A file is
trusted only when its length, magic, checksum and every header field match what the reader asked for.
A reader reads the payload straight into the buffer it will copy from (no copy of the whole file)."""
import json
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

import xxhash

MAGIC = b"NVKVBLK2"
_LEN = struct.Struct("<I")
_SUM = struct.Struct("<Q")
START = len(MAGIC) + _LEN.size


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
    digest = xxhash.xxh3_64()
    for piece in pieces:
        digest.update(piece)
    return pieces + [_SUM.pack(digest.intdigest())]


def read_into(f: BinaryIO, size: int, fingerprint: str, key: BlockKey, outs: list[memoryview]) -> None:
    """Read a file of `size` bytes holding key's block, its payload into outs in turn (one read
    call: the buffers may be the cache's own memory); BadBlockFile saying what is wrong with it
    otherwise (the buffers' contents then mean nothing)."""
    payload_len = sum(out.nbytes for out in outs)
    head = f.read(START)
    if len(head) < START or head[:len(MAGIC)] != MAGIC:
        raise BadBlockFile(f"not a block file ({size} bytes, no magic)")
    (header_len,) = _LEN.unpack_from(head, len(MAGIC))
    expected_size = START + header_len + payload_len + _SUM.size
    if size != expected_size:
        raise BadBlockFile(f"{size} bytes where {expected_size} were expected (truncated, or another layout)")
    header = f.read(header_len)
    read = os.preadv(f.fileno(), outs, START + header_len) if _is_file(f) \
        else sum(f.readinto(out) for out in outs)
    f.seek(START + header_len + payload_len)
    tail = f.read(_SUM.size)
    if len(header) != header_len or read != payload_len or len(tail) != _SUM.size:
        raise BadBlockFile("shorter than its size (truncated while read)")
    digest = xxhash.xxh3_64(head)
    digest.update(header)
    for out in outs:
        digest.update(out)
    if _SUM.unpack(tail)[0] != digest.intdigest():
        raise BadBlockFile("checksum mismatch (corrupted)")
    expected = _header(fingerprint, key, payload_len)
    if header != expected:  # the writer wrote exactly these bytes; parsed only to say what differs
        try:
            found = json.loads(header)
        except ValueError as e:
            raise BadBlockFile(f"unreadable header: {e}") from None
        wanted = json.loads(expected)
        wrong = sorted(k for k in wanted if found.get(k) != wanted[k]) if isinstance(found, dict) else ["all"]
        raise BadBlockFile(f"holds another block (differs in {', '.join(wrong) or 'its layout'})")


def _is_file(f) -> bool:
    try:
        f.fileno()
        return True
    except (OSError, ValueError, AttributeError):
        return False
