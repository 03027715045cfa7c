"""Tensor-parallel worker side: the shared-memory call channel and worker_main, the loop of ranks
1..N-1 that runs rank 0's ModelRunner calls on its own shard. Started by distributed/tp_runner.py."""
import datetime
import logging
import multiprocessing as mp
import pickle
import signal
import struct
from multiprocessing import shared_memory
from multiprocessing.connection import Connection

import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# NOTE: the only ModelRunner methods rank 0 can make a worker call; anything else is refused.
ALLOWED_METHODS = frozenset({"run", "exit"})
HOST = "127.0.0.1"  # every rank lives on this machine
_HEADER = struct.Struct("<Q")  # length of the pickled message that follows


def channel_bytes(config: Config) -> int:
    """Shared memory that fits the largest step: full token ids and block tables of every sequence."""
    return (1 << 20) + config.max_num_seqs * (1024 + 6 * config.max_model_len)


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
    """This rank's process set up by the platform (CUDA: its GPU; CPU: its share of the cores),
    then the group on the platform's backend (NCCL / gloo)."""
    platform = config.platform
    platform.set_up_rank(rank, config.tensor_parallel_size)
    dist.init_process_group(platform.dist_backend, store=store, rank=rank, world_size=config.tensor_parallel_size,
                            timeout=datetime.timedelta(seconds=config.dist_timeout_s))


def worker_main(config: Config, rank: int, port: int, shm_name: str, conn: Connection) -> None:
    """Entry point of rank `rank` (>= 1): build this rank's shard, then serve rank 0's calls until exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when workers stop
    conn.send_bytes(b"started")
    timeout = datetime.timedelta(seconds=config.dist_timeout_s)
    store = dist.TCPStore(HOST, port, config.tensor_parallel_size, is_master=False, timeout=timeout)
    init_process_group(config, rank, store)
    channel = CallChannel(shm_name)
    try:
        serve(ModelRunner(config, rank), channel, conn)
    except Exception:
        parent = mp.parent_process()
        if parent is not None and not parent.is_alive():
            logger.warning("tensor-parallel rank %d: rank 0 is gone, exiting", rank)
            return
        raise
    finally:
        channel.close()
        dist.destroy_process_group()


def serve(runner: ModelRunner, channel: CallChannel, conn: Connection) -> None:
    while True:
        try:
            conn.recv_bytes()  # a call is in the channel
        except EOFError:
            logger.warning("tensor-parallel rank %d: rank 0 is gone, exiting", runner.rank)
            return
        method, args = channel.read()
        conn.send_bytes(b"")  # NOTE: only after reading: rank 0 overwrites the channel once every worker acked
        getattr(runner, method)(*args)
        if method == "exit":
            return
