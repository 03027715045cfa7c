"""Tensor-parallel rank and world size, read from torch.distributed (rank 0 of 1 when not started)."""
import torch.distributed as dist


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator
