"""Tensor parallelism, rank 0's side: TensorParallelRunner spawns this node's ranks (tp_worker.worker_main)
and mirrors every allowed ModelRunner call to all ranks: on one node the call in shared memory and a
one-byte note on a pipe per worker to wake it; across nodes a gloo broadcast. Built by LLMEngine."""
import atexit
import datetime
import logging
import multiprocessing as mp
import multiprocessing.connection
import uuid
import weakref

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.executor.abstract import Executor
from nanovllm.executor.model_runner import ModelRunner
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.sample.sampler import SampledTokens
from nanovllm.distributed import node
from nanovllm.distributed.broadcast_channel import BroadcastChannel
from nanovllm.distributed.tp_worker import (ALLOWED_METHODS, CallChannel, channel_bytes, init_process_group,
                                            listening_store, rendezvous_address, uses_broadcast, worker_main)

logger = logging.getLogger(__name__)

_JOIN_S = 10.0  # how long exit() lets a worker finish before terminating it


class WorkerPool:
    """Ranks 1..N-1 (those of node 0 as spawned processes), the channel that tells them what to run,
    and the store (in this process: the other nodes' ranks report their failure and exit there).

    NOTE: workers are woken and acknowledge through pipes, not multiprocessing Events: an Event's
    lock held by a worker at the moment it is killed would block rank 0 forever; a pipe just closes.
    """

    def __init__(self, config: Config):
        n, local = config.tensor_parallel_size, config.tensor_parallel_size // config.nnodes
        ctx = mp.get_context("spawn")
        timeout = datetime.timedelta(seconds=config.dist_timeout_s)
        host, port = rendezvous_address(config)
        try:
            # Port 0 lets the OS pick a free port, so engines on one machine never collide.
            self.store = listening_store(host, port, n, timeout)
        except (RuntimeError, OSError) as e:
            if config.dist_init_addr is None:
                raise RuntimeError(f"cannot listen on {host}:{port} (dist_port): {e}") from e
            raise RuntimeError(f"cannot listen on {host}:{port} (dist_init_addr: an address of this machine, "
                               f"node 0, with a free port): {e}") from e
        self.config = config
        self.channel: CallChannel | BroadcastChannel | None = None  # a broadcast needs the group first
        name = None
        if uses_broadcast(config):
            node.publish_settings(self.store, config)
        else:
            name = config.dist_shm_name or f"nanovllm-{uuid.uuid4().hex[:16]}"
            try:
                self.channel = CallChannel(name, channel_bytes(config))
            except FileExistsError as e:
                raise RuntimeError(f"shared memory {name!r} (dist_shm_name) is in use by another engine") from e
        pipes = [ctx.Pipe() for _ in range(1, local)]
        self.conns = [ours for ours, _ in pipes]
        self.pending = [False] * (local - 1)  # a worker has not yet acknowledged the last call
        self.workers = [ctx.Process(target=worker_main, name=f"nanovllm-tp-rank{rank}", daemon=True,
                                    args=(config, rank, self.store.port, name, pipes[rank - 1][1]))
                        for rank in range(1, local)]
        self.timeout_s = config.dist_timeout_s
        self.old_num_threads = torch.get_num_threads()
        self.is_shut_down = False
        self.is_broken = False  # set when ranks may disagree on where they are
        try:
            for p in self.workers:
                p.start()
        except BaseException:
            self.is_broken = True
            self.shutdown()
            raise
        finally:
            for _, theirs in pipes:
                theirs.close()  # so that a worker's death shows as end-of-file on our side

    def receive(self, i: int, what: str, timeout_s: float) -> None:
        """Wait for worker i's next note (start-up done, call taken); raise if it dies or times out."""
        conn, p = self.conns[i], self.workers[i]
        ready = mp.connection.wait([conn, p.sentinel], timeout=timeout_s)
        if conn in ready:
            try:
                conn.recv_bytes()
                return
            except (EOFError, OSError):
                pass
        if not ready:
            raise RuntimeError(f"{p.name} did not {what} within {timeout_s}s")
        p.join(5.0)  # its pipe closed: it is exiting
        self.check_alive()
        raise RuntimeError(f"{p.name} closed its pipe to rank 0")

    def wait_started(self) -> None:
        """Wait until every worker runs its own code (imports done), or raise if one died first."""
        for i in range(len(self.workers)):
            self.receive(i, "start", self.timeout_s)

    def dead_workers(self) -> list[str]:
        dead = [f"{p.name} (pid {p.pid}, exit code {p.exitcode})" for p in self.workers if not p.is_alive()]
        remote = node.remote_death(self.store) if self.config.nnodes > 1 and self.store is not None else None
        return dead + ([remote] if remote else [])

    def check_alive(self) -> None:
        dead = self.dead_workers()
        if dead:
            raise RuntimeError(f"tensor-parallel worker {', '.join(dead)} died; the engine cannot continue")

    def send(self, method: str, args: tuple, timeout_s: float | None = None) -> None:
        """Publish one call. First waits (in practice never: the last call's collectives synchronized
        every rank) until every worker has read the previous one."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if isinstance(self.channel, BroadcastChannel):
            self.check_alive()
            self.channel.write(method, args)  # NOTE: the broadcast is the wake-up; every rank waits in it
            return
        for i in range(len(self.workers)):
            if self.pending[i]:
                self.receive(i, "take the previous call", timeout_s)
                self.pending[i] = False
        self.check_alive()
        self.channel.write(method, args)
        for i, conn in enumerate(self.conns):
            try:
                conn.send_bytes(b"")
            except OSError:  # its end is closed: the worker is gone
                self.receive(i, "take a call", timeout_s)
            self.pending[i] = True

    def wait_for_death(self, timeout_s: float) -> None:
        """Give a worker whose socket just closed the moment it needs to show up as dead."""
        ready = mp.connection.wait([p.sentinel for p in self.workers], timeout=timeout_s)
        for p in self.workers:
            if p.sentinel in ready:
                # NOTE: a closed sentinel means the process is exiting, but it may not be reapable yet
                # (so is_alive() would still say True); a blocking join returns as soon as it is.
                p.join()
        if not ready and self.config.nnodes > 1 and self.store is not None:
            try:  # another node's watcher names its dead rank within about a second
                self.store.wait([node.DEAD_KEY], datetime.timedelta(seconds=timeout_s))
            except Exception:  # noqa: BLE001 - nobody died there
                pass

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
        if graceful and self.config.nnodes > 1 and not node.wait_remote_exit(self.store, self.config, _JOIN_S):
            logger.warning("a tensor-parallel rank on another node did not report its exit within %ss", _JOIN_S)
        for p in self.workers:
            if p.pid is None:
                continue  # never started
            p.join(_JOIN_S if graceful else 0.5)
            for stop in (p.terminate, p.kill):
                if p.is_alive():
                    stop()
                    p.join(2.0)
        for conn in self.conns:
            conn.close()
        if self.channel is not None:
            self.channel.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = None
        torch.set_num_threads(self.old_num_threads)


def join(config: Config, store: dist.TCPStore) -> None:
    """Rank 0 into the process group; across nodes, a timeout says which address waited for whom."""
    try:
        init_process_group(config, 0, store)
    except (RuntimeError, OSError) as e:
        if config.nnodes == 1:
            raise
        raise RuntimeError(f"not every node joined the rendezvous at {config.dist_init_addr} (dist_init_addr) "
                           f"within {config.dist_timeout_s}s (dist_timeout_s); start `nanovllm worker MODEL "
                           f"--nnodes {config.nnodes} --node-rank K --dist-init-addr {config.dist_init_addr}` on "
                           f"nodes 1..{config.nnodes - 1} ({e})") from e


class TensorParallelRunner(Executor):
    """The tensor-parallel Executor: rank 0's ModelRunner plus its workers, each call run on every rank."""

    can_time_steps = False  # a forward needs every rank: no process times one alone

    def __init__(self, config: Config):
        self.runner: ModelRunner | None = None
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this process "
                               "(another tensor-parallel engine?); exit() it before creating a new one")
        if config.node_rank != 0:
            raise ValueError(f"node_rank {config.node_rank}: the engine runs on node 0; run "
                             "`nanovllm worker MODEL --nnodes N --node-rank K --dist-init-addr HOST:PORT` on the others")
        self.pool = pool = WorkerPool(config)
        # Ends the workers on exit(), on garbage collection and at interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, pool.shutdown)
        atexit.register(self._finalizer)
        try:
            pool.wait_started()
            join(config, pool.store)
            if pool.channel is None:
                pool.channel = BroadcastChannel(ALLOWED_METHODS)
            self.runner = ModelRunner(config, rank=0)
        except BaseException as e:
            pool.is_broken = True  # workers may be anywhere in their start-up: terminate, don't ask
            if isinstance(e, Exception):
                pool.wait_for_death(2.0)
            dead = pool.dead_workers()
            self.exit()
            if dead and isinstance(e, Exception):
                raise RuntimeError(f"tensor-parallel worker {', '.join(dead)} died while the engine started; "
                                   "if at once, check that the script creating the LLM is guarded by "
                                   "`if __name__ == '__main__':` (workers are spawned)") from e
            raise
        self.num_kvcache_blocks = self.runner.num_kvcache_blocks
        self.weight_bytes = self.runner.weight_bytes  # rank 0's (the ranks hold equal shares)
        self.lora = self.runner.lora  # rank 0's: requests' adapters are checked there; each rank reads its own

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
        except BaseException as e:
            # NOTE: ranks may now disagree on where they are (Ctrl-C included); no later call can be trusted.
            self.pool.is_broken = True
            if isinstance(e, Exception):
                self.pool.wait_for_death(5.0)
                self.pool.check_alive()
            raise

    def run(self, out: SchedulerOutput, drafts: list[list[int]] | None = None) -> SampledTokens | None:
        return self.call("run", out, drafts)

    def embed(self, token_lists: list[list[int]], pooling: str, normalize: bool = True,
              lora: tuple | None = None) -> torch.Tensor:
        raise ValueError("embed() runs with tensor_parallel_size=1")

    @property
    def kv_groups(self) -> list:
        return self.runner.kv_groups  # rank 0's: every rank holds the same layers' groups

    @property
    def num_state_slots(self) -> int:
        return self.runner.num_state_slots

    @property
    def step_notes(self) -> list[str]:
        return self.runner.step_notes  # rank 0's: every rank builds the same step runners

    def kv_token_bytes(self) -> int:
        return self.runner.kv_token_bytes()

    def kv_block_bytes(self) -> int:
        return self.runner.kv_block_bytes()

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        raise ValueError("KV offloading runs with one process (tensor_parallel_size 1): each rank's cache "
                         "holds its own heads")

    def write_kv_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.read_kv_blocks(block_ids)

    def kv_block_memory(self, block_id: int) -> list[memoryview] | None:
        return None

    def broken_reason(self) -> str | None:
        """Why no further call can run: a worker (or another node's rank) died, or a failed call left
        the ranks apart; None while every rank is well."""
        dead = self.pool.dead_workers() if not self.pool.is_shut_down else []
        if dead:
            return f"tensor-parallel worker {', '.join(dead)} died"
        if self.pool.is_broken:
            return "a tensor-parallel step failed, so the ranks may disagree on where they are"
        return None

    @property
    def device(self) -> torch.device:
        return self.runner.device  # rank 0's

    @property
    def backend(self):
        return self.runner.backend

    def exit(self) -> None:
        """End the workers, destroy the process group and unlink the shared memory. Idempotent."""
        if self.runner is not None:
            self.runner.exit()
            self.runner = None
        self.pool.shutdown()
        self._finalizer.detach()
        atexit.unregister(self._finalizer)
