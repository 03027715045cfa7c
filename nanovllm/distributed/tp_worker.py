"""Tensor-parallel worker side: the shared-memory call channel and worker_main, the loop of ranks
1..N-1 that runs rank 0's ModelRunner calls on its own shard. Started by distributed/tp_runner.py
(node 0) and distributed/node.py (the other nodes)."""
import datetime
import logging
import multiprocessing as mp
import pickle
import signal
import socket
import struct
from multiprocessing import shared_memory
from multiprocessing.connection import Connection

import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine_args import parse_init_addr
from nanovllm.distributed.broadcast_channel import BroadcastChannel
from nanovllm.executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# NOTE: the only ModelRunner methods rank 0 can make a worker call; anything else is refused.
ALLOWED_METHODS = frozenset({"run", "exit"})
HOST = "127.0.0.1"  # the rendezvous host of a single-node engine
SETTINGS_KEY = "config"  # in node 0's store: its engine settings for the other nodes (distributed/node.py)
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


def listening_store(host: str, port: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """Node 0's TCPStore, listening on host only. NOTE: given just a host name, TCPStore's server
    listens on every interface (`::`); a socket bound here to host's address is handed to it
    instead, so a single-node engine listens on loopback and a multi-node one on dist_init_addr."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        bound = sock.getsockname()[1]
        store = dist.TCPStore(host, bound, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now
    return store


def rendezvous_address(config: Config) -> tuple[str, int]:
    """Where node 0's TCPStore listens: dist_init_addr, else this machine (port 0: a free one)."""
    if config.dist_init_addr is not None:
        return parse_init_addr(config.dist_init_addr)
    return HOST, config.dist_port or 0


def uses_broadcast(config: Config) -> bool:
    """NOTE: the one place that picks the call channel: shared memory (+ a pipe per worker to wake it)
    on one host; a gloo broadcast once ranks live on other hosts."""
    return config.nnodes > 1


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of node 0's store; raises naming the address when it is not reached in timeout_s."""
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as e:  # DistNetworkError is a RuntimeError
        raise RuntimeError(f"cannot reach the rendezvous at {host}:{port} (dist_init_addr) within "
                           f"{timeout_s}s (dist_timeout_s); is node 0 started? ({e})") from e


def init_process_group(config: Config, rank: int, store: dist.Store) -> None:
    """This rank's process set up by the platform (CUDA: its GPU; CPU: its share of the cores),
    then the group on the platform's backend (NCCL / gloo)."""
    platform = config.platform
    platform.set_up_rank(rank, config.tensor_parallel_size // config.nnodes)  # ranks on this node
    try:
        dist.init_process_group(platform.dist_backend, store=store, rank=rank,
                                world_size=config.tensor_parallel_size,
                                timeout=datetime.timedelta(seconds=config.dist_timeout_s))
    except BaseException:
        forget_failed_group()
        raise


def forget_failed_group() -> None:
    """NOTE: torch names the default group from a counter it bumps before connecting and resets only
    when that group is destroyed; after a failed start (a node that never joined) the next engine of
    this process would rendezvous under another name than its fresh workers, and wait forever."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and not dist.is_initialized():
        world.group_count = 0


def worker_main(config: Config, rank: int, port: int, shm_name: str | None, conn: Connection) -> None:
    """Entry point of rank `rank` (>= 1): build this rank's shard, then serve rank 0's calls until exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when workers stop
    conn.send_bytes(b"started")
    store = connect_store(rendezvous_address(config)[0], port, config.dist_timeout_s)
    init_process_group(config, rank, store)
    broadcast = uses_broadcast(config)
    channel = BroadcastChannel(ALLOWED_METHODS) if broadcast else CallChannel(shm_name)
    try:
        serve(ModelRunner(config, rank), channel, None if broadcast else conn)
    except Exception:
        if rank0_is_gone(store):
            logger.warning("tensor-parallel rank %d: rank 0 is gone, exiting", rank)
            return
        raise
    finally:
        channel.close()
        dist.destroy_process_group()
    if broadcast:
        store.set(f"exited/{rank}", "1")  # rank 0's exit() waits for this from ranks it did not start


def rank0_is_gone(store: dist.Store) -> bool:
    """Whether the step that just failed failed because rank 0 is gone (then exiting is no error)."""
    parent = mp.parent_process()
    if parent is not None and not parent.is_alive():
        return True
    try:
        store.check([SETTINGS_KEY])  # rank 0's process holds the store: unreachable once it is gone
        return False
    except Exception:  # noqa: BLE001 - any failure of the store means its owner is gone
        return True


def serve(runner: ModelRunner, channel: CallChannel | BroadcastChannel, conn: Connection | None) -> None:
    """Run calls until "exit". `conn` wakes us for each call in shared memory; a broadcast wakes itself."""
    while True:
        if conn is not None:
            try:
                conn.recv_bytes()  # a call is in the channel
            except EOFError:
                logger.warning("tensor-parallel rank %d: rank 0 is gone, exiting", runner.rank)
                return
        method, args = channel.read()
        if conn is not None:
            conn.send_bytes(b"")  # NOTE: only after reading: rank 0 overwrites the channel once every worker acked
        getattr(runner, method)(*args)
        if method == "exit":
            return
