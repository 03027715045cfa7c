"""KVTier: the tier under the prefix cache. The KV cache manager asks it which blocks it holds and
starts reads of a request's blocks; the connector hands it new blocks to write and collects finished
reads. Writes and reads run on one worker thread (reads first: a request waits on them), so no engine
step waits for disk I/O: a read also copies each block into the cache's block (`fill`, the Executor's
write_kv_blocks), blocks that no step touches while their sequence waits. A write that finds the queue
over its bound is dropped, never waited for."""
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from nanovllm.kv_offload.block_file import BadBlockFile, BlockKey
from nanovllm.kv_offload.stores import DiskStore, RamStore

logger = logging.getLogger(__name__)

MAX_QUEUED_WRITE_BYTES = 1 << 30  # K/V waiting to be written; past it new blocks are dropped
FILL_BLOCKS = 16  # blocks read, then copied into the cache together (a cancel waits for one such batch at most)


@dataclass
class TierStats:
    """Counters since start (the server's /metrics carries them over)."""

    query_tokens: int = 0    # prompt tokens looked up in the tier (those the engine's cache missed)
    hit_tokens: int = 0      # of those, tokens read back instead of prefilled
    blocks_read: int = 0
    bytes_read: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    writes_dropped: int = 0  # blocks not written: the queue was over its bound
    bad_files: int = 0       # truncated, corrupted or foreign files found (deleted, recomputed)
    io_errors: int = 0       # reads or writes that failed (their blocks recomputed or not kept)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class KVTier:
    def __init__(self, block_bytes: int, ram_bytes: int = 0, disk: DiskStore | None = None):
        assert ram_bytes > 0 or disk is not None
        self.block_bytes = block_bytes
        # Copies rows of K/V into the cache's blocks (the Executor's write_kv_blocks; the connector sets it).
        self.fill: Callable[[list[int], torch.Tensor], None] | None = None
        # A block's memory in the cache, where the host can write it in place (the Executor's
        # kv_block_memory): reads then go straight from the file into the cache.
        self.block_memory: Callable[[int], list[memoryview] | None] | None = None
        self.ram = RamStore(ram_bytes) if ram_bytes > 0 else None
        self.disk = disk
        self.stats = TierStats()
        self._cv = threading.Condition()
        self._loads: deque[tuple[int, list[BlockKey], list[int]]] = deque()
        self._writes: deque[tuple[list[BlockKey], torch.Tensor]] = deque()
        self._queued_write_bytes = 0
        self._busy = False
        self._loading_seq: int | None = None  # the read the worker is doing
        self._batch: torch.Tensor | None = None  # the worker's read buffer: FILL_BLOCKS blocks, reused
        self._done: dict[int, int] = {}
        self._cancelled: set[int] = set()
        self._closing = False
        self._warned: set[str] = set()
        self._thread = threading.Thread(target=self._work, name="nanovllm-kv-offload", daemon=True)
        self._thread.start()

    def describe(self) -> str:
        parts = []
        if self.ram is not None:
            parts.append(f"{self.ram.max_bytes / 2**30:.2f} GiB of host RAM")
        if self.disk is not None:
            role = "owner: evicts" if self.disk.owner else "shared with its owner"
            parts.append(f"{self.disk.root} ({self.disk.max_bytes / 2**30:.2f} GiB, {role})")
        return "KV offloading (native): prefix blocks written through to " + " and ".join(parts)

    # ---- the KV cache manager's side (engine thread) ------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return (self.ram is not None and self.ram.contains(key)) or (self.disk is not None and self.disk.contains(key))

    def start_load(self, seq_id: int, keys: list[BlockKey], block_ids: list[int]) -> None:
        """Read keys into the cache's blocks block_ids (one each), in order, stopping at the first
        miss; finished_loads() then says how many were filled."""
        with self._cv:
            self._cancelled.discard(seq_id)
            self._loads.append((seq_id, keys, block_ids))
            self._cv.notify_all()

    def cancel(self, seq_id: int) -> None:
        """Forget a read (its request was aborted). Returns once the worker writes none of its blocks
        any more, so they can go to other sequences."""
        with self._cv:
            self._done.pop(seq_id, None)
            self._loads = deque(job for job in self._loads if job[0] != seq_id)
            if self._loading_seq == seq_id:
                self._cancelled.add(seq_id)
                self._cv.wait_for(lambda: self._loading_seq != seq_id)
            self._cancelled.discard(seq_id)

    def finished_loads(self) -> dict[int, int]:
        """Each finished read's count of keys filled (the leading ones: a read stops at its first miss)."""
        with self._cv:
            done, self._done = self._done, {}
        return done

    def wait(self, timeout: float) -> None:
        """Until a read finishes, or timeout seconds (an engine with only reads in flight)."""
        with self._cv:
            if not self._done:
                self._cv.wait(timeout)

    # ---- the connector's side (engine thread) -------------------------------------------------
    def save(self, keys: list[BlockKey], data: torch.Tensor) -> None:
        """Queue new blocks (rows of data, uint8, block_bytes each) to be written."""
        if self.ram is not None:
            for key, row in zip(keys, data):
                self.ram.put(key, row.clone())
        if self.disk is None or self.disk.writes_off is not None:
            return
        with self._cv:
            if self._queued_write_bytes + data.numel() > MAX_QUEUED_WRITE_BYTES:
                self.stats.writes_dropped += len(keys)
                self._warn_once("dropped", "KV offloading: %s is behind (over %d MiB queued); new blocks are "
                                "not written until it catches up", self.disk.root, MAX_QUEUED_WRITE_BYTES >> 20)
                return
            self._queued_write_bytes += data.numel()
            self._writes.append((keys, data))
            self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write and read is done; whether they were."""
        with self._cv:
            return self._cv.wait_for(lambda: not (self._writes or self._loads or self._busy), timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued writes (up to timeout seconds), then stop the worker."""
        self.flush(timeout)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout)
        if self.disk is not None:
            self.disk.close()

    # ---- the worker ---------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._loads or self._writes or self._closing)
                if self._closing and not self._loads and not self._writes:
                    return
                job = ("load", self._loads.popleft()) if self._loads else ("write", self._writes.popleft())
                self._busy = True
                if job[0] == "load":
                    self._loading_seq = job[1][0]
            try:
                if job[0] == "load":
                    seq_id, keys, block_ids = job[1]
                    filled = self._load(seq_id, keys, block_ids)
                    with self._cv:
                        if seq_id not in self._cancelled:
                            self._done[seq_id] = filled
                else:
                    keys, data = job[1]
                    self._write(keys, data)
                    with self._cv:
                        self._queued_write_bytes -= data.numel()
            except Exception:  # a bug here must not stop the tier's thread: the work is lost, not the engine
                logger.exception("KV offloading: %s failed", job[0])
            finally:
                with self._cv:
                    self._busy = False
                    self._loading_seq = None
                    self._cv.notify_all()

    def _load(self, seq_id: int, keys: list[BlockKey], block_ids: list[int]) -> int:
        """Read keys and copy them into block_ids, FILL_BLOCKS at a time, until a miss or a cancel;
        the count filled."""
        in_place = self.block_memory is not None and self.block_memory(block_ids[0]) is not None
        if not in_place and self._batch is None:
            self._batch = torch.empty(FILL_BLOCKS, self.block_bytes, dtype=torch.uint8)
        filled = 0
        while filled < len(keys):
            with self._cv:
                if seq_id in self._cancelled:
                    break
            n = 0
            for i, key in enumerate(keys[filled:filled + FILL_BLOCKS]):
                outs = self.block_memory(block_ids[filled + i]) if in_place else [memoryview(self._batch[i].numpy())]
                if not self._read(key, outs):
                    break
                n += 1
            if n and not in_place:
                self.fill(block_ids[filled:filled + n], self._batch[:n])
            filled += n
            if n < FILL_BLOCKS:
                break
        self.stats.blocks_read += filled
        return filled

    def _read(self, key: BlockKey, outs: list[memoryview]) -> bool:
        """Read key's K/V (RAM, then the directory) into outs in turn; whether it was found."""
        data = self.ram.get(key) if self.ram is not None else None
        if data is not None:
            offset = 0
            for out in outs:
                out[:] = memoryview(data.numpy())[offset:offset + out.nbytes]
                offset += out.nbytes
            return True
        found = False
        if self.disk is not None:
            try:
                found = self.disk.read(key, outs)
            except BadBlockFile:
                self.stats.bad_files += 1
            except OSError as e:
                self.stats.io_errors += 1
                self._warn_once(f"read {e.errno}", "KV offloading: a read failed (%s); its tokens are computed", e)
        if not found:
            return False
        self.stats.bytes_read += self.block_bytes
        if self.ram is not None:
            self.ram.put(key, torch.cat([torch.frombuffer(out, dtype=torch.uint8) for out in outs]))
        return True

    def _write(self, keys: list[BlockKey], data: torch.Tensor) -> None:
        rows = data.numpy()
        for key, row in zip(keys, rows):
            try:
                nbytes = self.disk.write(key, memoryview(row))
            except OSError as e:
                self.stats.io_errors += 1
                self._warn_once(f"write {e.errno}", "KV offloading: a write failed (%s); that block is not kept", e)
                continue
            if nbytes:
                self.stats.blocks_written += 1
                self.stats.bytes_written += nbytes

    def _warn_once(self, what: str, message: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(message, *args)
