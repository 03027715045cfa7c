"""Tensor-parallel rank and world size, read from torch.distributed (rank 0 of 1 when not started,
and inside single_rank())."""
import threading
from contextlib import contextmanager

import torch.distributed as dist

_local = threading.local()


@contextmanager
def single_rank():
    """Build or run a model that is not sharded in a process holding a tensor-parallel rank (a
    draft model beside rank 0 of its target): inside, this thread is rank 0 of 1."""
    before = getattr(_local, "single", False)
    _local.single = True
    try:
        yield
    finally:
        _local.single = before


def _in_group() -> bool:
    return dist.is_available() and dist.is_initialized() and not getattr(_local, "single", False)


def get_tp_rank() -> int:
    return dist.get_rank() if _in_group() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if _in_group() else 1


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator
