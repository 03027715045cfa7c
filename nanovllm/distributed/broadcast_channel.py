"""The call channel across machines: rank 0's pickled (method, args) broadcast on a gloo group (its
length first, then its bytes). Same interface as tp_worker.CallChannel; used when nnodes > 1."""
import datetime
import pickle

import torch
import torch.distributed as dist

# NOTE: a worker waits in this group's broadcast for the next call as long as the engine idles, so
# its timeout is no bound on anything; a rank that dies still closes its sockets and fails the
# broadcast at once, and the model's own collectives keep dist_timeout_s.
_IDLE = datetime.timedelta(days=365)


class BroadcastChannel:
    """Rank 0 writes (broadcasts) each call, every other rank reads (receives) it. Built by every
    rank in the same order, right after the default process group (new_group is collective)."""

    def __init__(self, allowed_methods: frozenset[str]):
        self.allowed_methods = allowed_methods
        # On CPU the default group is gloo already; a group of its own keeps the long timeout apart.
        self.group = dist.new_group(backend="gloo", timeout=_IDLE)
        self.name = "gloo broadcast"

    def write(self, method: str, args: tuple) -> None:
        data = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.group)

    def read(self) -> tuple[str, tuple]:
        length = torch.empty(1, dtype=torch.int64)
        dist.broadcast(length, src=0, group=self.group)
        data = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.group)
        method, args = pickle.loads(data.numpy().tobytes())
        if method not in self.allowed_methods:
            raise ValueError(f"refusing to call ModelRunner.{method}: not in {sorted(self.allowed_methods)}")
        return method, args

    def close(self) -> None:
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None
