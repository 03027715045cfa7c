"""Tensor parallelism: rank 0's TensorParallelRunner spawns ranks 1..N-1 (worker_main, each with its
own ModelRunner shard) and mirrors every allowed runner call to them through shared memory.
LLMEngine builds it when tensor_parallel_size > 1."""
import atexit
import datetime
import logging
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.synchronize
import os
import pickle
import signal
import struct
import time
import uuid
import weakref
from multiprocessing import shared_memory

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import Sequence

logger = logging.getLogger(__name__)

# NOTE: the only ModelRunner methods rank 0 can make a worker call; anything else is refused.
ALLOWED_METHODS = frozenset({"run", "exit"})
_HOST = "127.0.0.1"  # every rank lives on this machine
_HEADER = struct.Struct("<Q")  # length of the pickled message that follows
_POLL_S = 0.2  # how often a waiting process checks that the other side is still alive
_JOIN_S = 10.0  # how long exit() lets a worker finish before terminating it


def channel_bytes(config: Config) -> int:
    """Shared memory that fits the largest step: full token ids and block tables of every sequence."""
    return (1 << 20) + config.max_num_seqs * (1024 + 6 * config.max_model_len)


def threads_per_rank(tp_size: int) -> int:
    """CPU threads for one rank, so that N ranks together do not oversubscribe the cores."""
    return max(1, len(os.sched_getaffinity(0)) // tp_size)


class CallChannel:
    """One pickled (method, args) message in shared memory: rank 0 writes it, workers read it."""

    def __init__(self, name: str, size: int | None = None):
        self.is_owner = size is not None
        self.shm = shared_memory.SharedMemory(name=name, create=self.is_owner, size=size or 0)
        self.name = name

    def write(self, method: str, args: tuple) -> None:
        data = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        end = _HEADER.size + len(data)
        if end > self.shm.size:
            raise RuntimeError(f"a {method!r} call needs {end} bytes of shared memory but the channel has "
                               f"{self.shm.size}; lower max_num_seqs or max_model_len")
        self.shm.buf[_HEADER.size:end] = data
        _HEADER.pack_into(self.shm.buf, 0, len(data))

    def read(self) -> tuple[str, tuple]:
        (n,) = _HEADER.unpack_from(self.shm.buf, 0)
        method, args = pickle.loads(bytes(self.shm.buf[_HEADER.size:_HEADER.size + n]))
        if method not in ALLOWED_METHODS:
            raise ValueError(f"refusing to call ModelRunner.{method}: not in {sorted(ALLOWED_METHODS)}")
        return method, args

    def close(self) -> None:
        self.shm.close()
        if self.is_owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


def init_process_group(config: Config, rank: int, store: dist.Store) -> None:
    """NCCL with one GPU per rank on CUDA, gloo with a share of the cores on CPU."""
    if config.device == "cuda":
        torch.cuda.set_device(rank)
        backend = "nccl"
    else:
        torch.set_num_threads(threads_per_rank(config.tensor_parallel_size))
        backend = "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=config.tensor_parallel_size,
                            timeout=datetime.timedelta(seconds=config.dist_timeout_s))


def worker_main(config: Config, rank: int, port: int, shm_name: str,
                ready: mp.synchronize.Event, call: mp.synchronize.Event) -> None:
    """Entry point of rank `rank` (>= 1): build this rank's shard, then serve rank 0's calls until exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when workers stop
    Sequence.block_size = config.kvcache_block_size
    ready.set()
    timeout = datetime.timedelta(seconds=config.dist_timeout_s)
    store = dist.TCPStore(_HOST, port, config.tensor_parallel_size, is_master=False, timeout=timeout)
    init_process_group(config, rank, store)
    channel = CallChannel(shm_name)
    try:
        serve(ModelRunner(config, rank), channel, call)
    finally:
        channel.close()
        dist.destroy_process_group()


def serve(runner: ModelRunner, channel: CallChannel, call: mp.synchronize.Event) -> None:
    parent = mp.parent_process()
    while True:
        if not call.wait(_POLL_S):
            if parent is not None and not parent.is_alive():
                logger.warning("tensor-parallel rank %d: rank 0 is gone, exiting", runner.rank)
                return
            continue
        method, args = channel.read()
        call.clear()  # NOTE: only after reading: rank 0 overwrites the channel once every event is clear
        getattr(runner, method)(*args)
        if method == "exit":
            return


class WorkerPool:
    """Ranks 1..N-1 as spawned processes, the channel that tells them what to run, and the store."""

    def __init__(self, config: Config):
        n = config.tensor_parallel_size
        ctx = mp.get_context("spawn")
        timeout = datetime.timedelta(seconds=config.dist_timeout_s)
        try:
            # Port 0 lets the OS pick a free port, so engines on one machine never collide.
            self.store = dist.TCPStore(_HOST, config.dist_port or 0, n, is_master=True,
                                       timeout=timeout, wait_for_workers=False)
        except (RuntimeError, OSError) as e:
            raise RuntimeError(f"cannot listen on {_HOST}:{config.dist_port} (dist_port): {e}") from e
        name = config.dist_shm_name or f"nanovllm-{uuid.uuid4().hex[:16]}"
        try:
            self.channel = CallChannel(name, channel_bytes(config))
        except FileExistsError as e:
            raise RuntimeError(f"shared memory {name!r} (dist_shm_name) is in use by another engine") from e
        self.ready = [ctx.Event() for _ in range(1, n)]
        self.calls = [ctx.Event() for _ in range(1, n)]
        self.workers = [ctx.Process(target=worker_main, name=f"nanovllm-tp-rank{rank}", daemon=True,
                                    args=(config, rank, self.store.port, name, self.ready[rank - 1],
                                          self.calls[rank - 1]))
                        for rank in range(1, n)]
        self.timeout_s = config.dist_timeout_s
        self.old_num_threads = torch.get_num_threads()
        self.is_shut_down = False
        self.is_broken = False  # set when ranks may disagree on where they are
        for p in self.workers:
            p.start()

    def wait_started(self) -> None:
        """Wait until every worker runs its own code (imports done), or raise if one died first."""
        deadline = time.monotonic() + self.timeout_s
        for event, p in zip(self.ready, self.workers):
            while not event.wait(_POLL_S):
                self.check_alive()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{p.name} did not start within dist_timeout_s={self.timeout_s}s")

    def dead_workers(self) -> list[str]:
        return [f"{p.name} (pid {p.pid}, exit code {p.exitcode})" for p in self.workers if not p.is_alive()]

    def check_alive(self) -> None:
        dead = self.dead_workers()
        if dead:
            raise RuntimeError(f"tensor-parallel worker {', '.join(dead)} died; the engine cannot continue")

    def send(self, method: str, args: tuple, timeout_s: float | None = None) -> None:
        """Publish one call; waits (in practice never: the last call's collectives synchronized every
        rank) until every worker has read the previous one."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while any(event.is_set() for event in self.calls):
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not take a call within {timeout_s}s")
            time.sleep(0.001)
        self.check_alive()
        self.channel.write(method, args)
        for event in self.calls:
            event.set()

    def wait_for_death(self, timeout_s: float) -> None:
        """Give a worker whose socket just closed the moment it needs to show up as dead."""
        sentinels = [p.sentinel for p in self.workers]
        mp.connection.wait(sentinels, timeout=timeout_s)

    def shutdown(self) -> None:
        """End every worker (asking first while they are in step), then free the channel and the group."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        graceful = not self.is_broken and not self.dead_workers()
        try:
            if graceful:
                self.send("exit", (), timeout_s=_JOIN_S)
        except Exception:
            logger.warning("could not ask the tensor-parallel workers to exit; terminating them", exc_info=True)
        for p in self.workers:
            p.join(_JOIN_S if graceful else 0.5)
            for stop in (p.terminate, p.kill):
                if p.is_alive():
                    stop()
                    p.join(2.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = None
        self.channel.close()
        torch.set_num_threads(self.old_num_threads)


class TensorParallelRunner:
    """Rank 0's ModelRunner plus its workers; LLMEngine uses it like a ModelRunner."""

    def __init__(self, config: Config):
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this process "
                               "(another tensor-parallel engine?); exit() it before creating a new one")
        self.pool = pool = WorkerPool(config)
        # Ends the workers on exit(), on garbage collection and at interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, pool.shutdown)
        atexit.register(self._finalizer)
        try:
            pool.wait_started()
            init_process_group(config, 0, pool.store)
            self.runner = ModelRunner(config, rank=0)
        except Exception as e:
            pool.is_broken = True
            pool.wait_for_death(2.0)
            dead = pool.dead_workers()
            self.exit()
            if dead:
                raise RuntimeError(f"tensor-parallel worker {', '.join(dead)} died while the engine started; "
                                   "if at once, check that the script creating the LLM is guarded by "
                                   "`if __name__ == '__main__':` (workers are spawned)") from e
            raise
        except BaseException:
            self.exit()
            raise
        self.num_kvcache_blocks = self.runner.num_kvcache_blocks

    def call(self, method: str, *args):
        """Run ModelRunner.method on every rank; rank 0's result is returned."""
        if method not in ALLOWED_METHODS:
            raise ValueError(f"ModelRunner.{method} cannot be called on workers; allowed: {sorted(ALLOWED_METHODS)}")
        if self.pool.is_broken:
            self.pool.check_alive()
            raise RuntimeError("an earlier tensor-parallel step failed; the engine cannot continue")
        try:
            self.pool.send(method, args)
            return getattr(self.runner, method)(*args)
        except Exception:
            # NOTE: ranks may now disagree on where they are; no later call can be trusted.
            self.pool.is_broken = True
            self.pool.wait_for_death(5.0)
            self.pool.check_alive()
            raise

    def run(self, out: SchedulerOutput) -> list[int]:
        return self.call("run", out)

    def exit(self) -> None:
        """End the workers, destroy the process group and unlink the shared memory. Idempotent."""
        if getattr(self, "runner", None) is not None:
            self.runner.exit()
            self.runner = None
        self.pool.shutdown()
        self._finalizer.detach()
        atexit.unregister(self._finalizer)
