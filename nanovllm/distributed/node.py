"""Multi-node tensor parallelism: what node 0 publishes in its rendezvous store (engine settings,
a dead rank's name, ranks that exited) and run_node, the life of every other node: take node 0's
settings, spawn this node's ranks, end them when rank 0 goes. Called by `nanovllm worker`."""
import dataclasses
import datetime
import logging
import multiprocessing as mp
import multiprocessing.connection
import pickle
import time

import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine_args import check_nodes, parse_init_addr
from nanovllm.distributed.tp_worker import SETTINGS_KEY, connect_store, worker_main

logger = logging.getLogger(__name__)

DEAD_KEY = "dead"  # the first rank another node saw die, in words
_NODE_FIELDS = ("model", "node_rank", "dist_init_addr")  # each node's own
_GRACE_S = 10.0  # how long ranks may take to exit on their own once rank 0 is gone


def node_ranks(config: Config) -> range:
    per_node = config.tensor_parallel_size // config.nnodes
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


def remote_ranks(config: Config) -> range:
    """The ranks node 0 did not start."""
    return range(config.tensor_parallel_size // config.nnodes, config.tensor_parallel_size)


def publish_settings(store: dist.Store, config: Config) -> None:
    """NOTE: every node runs node 0's settings, so that no flag can differ between ranks."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(Config)
              if f.init and f.name not in _NODE_FIELDS}
    store.set(SETTINGS_KEY, pickle.dumps(fields))


def remote_death(store: dist.Store) -> str | None:
    try:
        return store.get(DEAD_KEY).decode() if store.check([DEAD_KEY]) else None
    except Exception:  # noqa: BLE001 - the store is ours (rank 0's); a failing read names nobody
        return None


def wait_remote_exit(store: dist.Store, config: Config, timeout_s: float) -> bool:
    """Wait until every rank of the other nodes reported its exit; False when one did not in time."""
    keys = [f"exited/{rank}" for rank in remote_ranks(config)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
        return True
    except Exception:  # noqa: BLE001 - a timeout; the caller logs it
        return False


def run_node(model: str, nnodes: int, node_rank: int, dist_init_addr: str, timeout_s: float = 600.0) -> int:
    """Run node `node_rank` (>= 1) of a multi-node engine until rank 0 ends it; the exit status:
    0 when every rank of this node exited cleanly."""
    check_nodes(nnodes, node_rank, dist_init_addr)
    if node_rank == 0:
        raise ValueError("node_rank 0 runs the engine (LLM(...) or `nanovllm serve`), not `nanovllm worker`")
    host, port = parse_init_addr(dist_init_addr)
    store = connect_store(host, port, timeout_s)
    settings = pickle.loads(store.get(SETTINGS_KEY))  # waits (store timeout) until node 0 published them
    engine_nnodes = settings.pop("nnodes")
    if engine_nnodes != nnodes:
        raise ValueError(f"nnodes ({nnodes}) differs from node 0's nnodes ({engine_nnodes})")
    config = Config(model, **settings, nnodes=nnodes, node_rank=node_rank, dist_init_addr=dist_init_addr)
    return supervise(config, store, port)


def supervise(config: Config, store: dist.Store, port: int) -> int:
    """Spawn this node's ranks, watch them, and leave none behind, whatever happens here."""
    ctx = mp.get_context("spawn")
    pipes, workers = [], []
    try:
        for rank in node_ranks(config):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=worker_main, name=f"nanovllm-tp-rank{rank}", daemon=True,
                            args=(config, rank, port, None, theirs))
            p.start()
            theirs.close()
            pipes.append(ours)  # NOTE: kept open: a worker's "started" note must not hit a closed pipe
            workers.append(p)
        logger.info("node %d: ranks %s started", config.node_rank, list(node_ranks(config)))
        return watch(config, store, workers)
    finally:
        for p in workers:
            for stop in (p.terminate, p.kill):
                if p.is_alive():
                    stop()
                    p.join(2.0)
        for conn in pipes:
            conn.close()


def watch(config: Config, store: dist.Store, workers: list) -> int:
    """Until every rank has exited: name a rank that failed to rank 0; end the ranks once rank 0 is gone."""
    alive = list(workers)
    while alive:
        ready = mp.connection.wait([p.sentinel for p in alive], timeout=1.0)
        for p in [p for p in alive if p.sentinel in ready]:
            p.join()
            alive.remove(p)
            if p.exitcode != 0:
                what = f"{p.name} (pid {p.pid}, exit code {p.exitcode}) on node {config.node_rank}"
                logger.error("tensor-parallel worker %s died", what)
                try:
                    store.set(DEAD_KEY, what)
                except Exception:  # noqa: BLE001 - rank 0 is gone too
                    pass
                return 1
        if alive and not ready and not rank0_alive(store):
            logger.warning("node %d: rank 0 is gone; ending this node's ranks", config.node_rank)
            deadline = time.monotonic() + _GRACE_S
            for p in alive:
                p.join(max(0.0, deadline - time.monotonic()))
            return 0 if all(p.exitcode == 0 for p in alive) else 1
    return 0


def rank0_alive(store: dist.Store) -> bool:
    try:
        store.check([SETTINGS_KEY])
        return True
    except Exception:  # noqa: BLE001 - any failure of the store means its owner, rank 0, is gone
        return False
