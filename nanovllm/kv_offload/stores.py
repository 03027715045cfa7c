"""Where the tier keeps blocks: RamStore (host RAM, LRU, bounded in bytes) and DiskStore (a directory,
bounded in bytes). Both are used by KVTier's worker thread and the engine thread; RamStore takes a lock,
DiskStore needs none (each file is written under a temporary name and renamed into place, so a reader,
in this process or another, sees a whole file or none)."""
import errno
import fcntl
import logging
import os
import threading
import time
from collections import OrderedDict
from itertools import count

import torch

from nanovllm.kv_offload.block_file import BadBlockFile, BlockKey, encode, read_into

logger = logging.getLogger(__name__)

STALE_TMP_S = 600.0  # a temporary file this old belongs to a writer that died (kill -9) mid-write
TRIM_TO = 0.9  # eviction takes the directory down to this fraction of its size


class RamStore:
    """Blocks in host RAM, least recently used evicted first."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.blocks: OrderedDict[BlockKey, torch.Tensor] = OrderedDict()
        self.nbytes = 0
        self._lock = threading.Lock()

    def contains(self, key: BlockKey) -> bool:
        return key in self.blocks

    def get(self, key: BlockKey) -> torch.Tensor | None:
        with self._lock:
            data = self.blocks.get(key)
            if data is not None:
                self.blocks.move_to_end(key)
            return data

    def put(self, key: BlockKey, data: torch.Tensor) -> None:
        if data.numel() > self.max_bytes:
            return
        with self._lock:
            if key in self.blocks:
                self.blocks.move_to_end(key)
                return
            self.blocks[key] = data
            self.nbytes += data.numel()
            while self.nbytes > self.max_bytes:
                _, old = self.blocks.popitem(last=False)
                self.nbytes -= old.numel()


class DiskStore:
    """Block files under root/<fingerprint>/ (a model, format or layout of its own never shares a
    folder, and a file's header is checked against the fingerprint anyway). The process holding
    root/.owner.lock evicts: it keeps root at most max_bytes, least recently used files first (a read
    touches its file); the others only read and write."""

    def __init__(self, root: str, max_bytes: int, fingerprint: str):
        self.root = os.path.abspath(root)
        self.fingerprint = fingerprint
        self.dir = os.path.join(self.root, fingerprint)
        self.max_bytes = max_bytes
        try:
            os.makedirs(self.dir, exist_ok=True)
            probe = os.path.join(self.dir, f".probe-{os.getpid()}")
            with open(probe, "wb") as f:
                f.write(b"ok")
            os.remove(probe)
            self._lock_file = open(os.path.join(self.root, ".owner.lock"), "a+b")
        except OSError as e:
            raise ValueError(f"kv_offloading_dir {root!r} is not a directory this process can write: {e}") from None
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.owner = True
        except OSError:
            self.owner = False  # another process owns it and evicts
        self._tmp_names = count()
        self.writes_off: str | None = None  # why this process stopped writing (a full disk)
        self.size_estimate = self.trim() if self.owner else 0

    def path(self, key: BlockKey) -> str:
        return os.path.join(self.dir, key.name)

    def contains(self, key: BlockKey) -> bool:
        return os.path.exists(self.path(key))

    def read(self, key: BlockKey, outs: list[memoryview]) -> bool:
        """Read the block's K/V bytes into outs in turn; False where no file holds it. A damaged or
        foreign file is logged, deleted and raised as BadBlockFile: it is never registered as cached."""
        path = self.path(key)
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            return False
        try:
            with f:
                read_into(f, os.fstat(f.fileno()).st_size, self.fingerprint, key, outs)
        except BadBlockFile as e:
            logger.warning("KV offloading: %s is unusable (%s); deleted, its tokens are computed again", path, e)
            _remove(path)
            raise
        try:
            os.utime(path)  # its last use, for eviction
        except OSError:
            pass  # evicted meanwhile: what was read is whole
        return True

    def write(self, key: BlockKey, payload: memoryview) -> int:
        """Write one block (unless a file holds it already); the bytes written. OSError on a fault; a
        full disk stops this process's writes (writes_off says why) with one WARNING."""
        if self.writes_off is not None:
            return 0
        path = self.path(key)
        if os.path.exists(path):
            return 0
        tmp = os.path.join(self.dir, f".tmp-{os.getpid()}-{threading.get_ident()}-{next(self._tmp_names)}")
        try:
            with open(tmp, "wb") as f:
                for piece in encode(self.fingerprint, key, payload):
                    f.write(piece)
                nbytes = f.tell()
            os.replace(tmp, path)  # atomic: readers see the whole file or none
        except OSError as e:
            _remove(tmp)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self.writes_off = f"{self.root}: {e.strerror}"
                logger.warning("KV offloading: no space left in %s; this process writes no more blocks there "
                               "(reads go on, serving goes on)", self.root)
                return 0
            raise
        if self.owner:
            self.size_estimate += nbytes
            if self.size_estimate > self.max_bytes:
                self.size_estimate = self.trim()
        return nbytes

    def trim(self) -> int:
        """(owner) Delete the least recently used block files until root holds at most TRIM_TO of
        max_bytes once over it, and temporary files left by dead writers; the bytes left."""
        files, total, now = [], 0, time.time()
        for sub in _scandir(self.root):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in _scandir(sub.path):
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if entry.name.startswith(".tmp-"):
                    if now - st.st_mtime > STALE_TMP_S:
                        _remove(entry.path)
                elif entry.name.endswith(".kvb"):
                    files.append((st.st_mtime, st.st_size, entry.path))
                    total += st.st_size
        if total > self.max_bytes:
            for _, size, path in sorted(files):
                if total <= TRIM_TO * self.max_bytes:
                    break
                if _remove(path):
                    total -= size
        return total

    def close(self) -> None:
        self._lock_file.close()  # releases ownership


def _scandir(path: str) -> list:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _remove(path: str) -> bool:
    try:
        os.remove(path)
        return True
    except OSError:
        return False
