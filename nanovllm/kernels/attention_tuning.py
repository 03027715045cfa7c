"""Launch parameters of the Triton attention kernels (nanovllm/kernels/triton_attention.py): tile
sizes per GPU generation, dtype and head_dim, and the split-K factor of decode."""
import functools

import torch

_MAX_SPLITS = 64
_MIN_SPLIT_TOKENS = 256  # below this many keys per split, the merge costs more than it saves


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device) -> int:
    """Split-K factor (a power of two) so that small batches with long contexts still fill the GPU.

    Depends only on host-side sizes, so a captured CUDA graph keeps one value; 1 off CUDA.
    """
    if device.type != "cuda":
        return 1
    programs = num_seqs * num_kv_heads
    num_sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= num_sms:
        return 1
    splits = min(-(-2 * num_sms // programs), _MAX_SPLITS)
    if max_context_len > 0:
        splits = min(splits, max(1, max_context_len // _MIN_SPLIT_TOKENS))
    return 1 << (splits.bit_length() - 1)  # round down to a power of two: few compiled variants


# Tiles per head_dim tile <= 64 / 128 / 256, picked so that neither sm_90 nor sm_80 builds spill
# registers or overflow shared memory (scripts/check_triton_build.py). Prefill: (BLOCK_M, BLOCK_N,
# warps, stages) keyed by (Hopper or newer?, fp32?); decode: (BLOCK_N, warps, stages) keyed by fp32?.
_PREFILL_TILES = {(True, False): ((128, 64, 8, 3), (128, 32, 8, 3), (64, 16, 8, 2)),
                  (True, True): ((64, 32, 8, 1), (64, 32, 8, 2), (32, 16, 8, 2)),
                  (False, False): ((128, 64, 8, 3), (64, 32, 8, 3), (64, 16, 8, 2)),
                  (False, True): ((32, 32, 4, 2), (32, 32, 8, 2), (16, 16, 4, 2))}
_DECODE_TILES = {False: ((64, 4, 3), (32, 4, 3), (32, 8, 2)),
                 True: ((32, 8, 2), (32, 8, 2), (16, 8, 2))}


def _size_class(block_d: int) -> int:
    return 0 if block_d <= 64 else 1 if block_d <= 128 else 2


def prefill_tiles(block_d: int, dtype: torch.dtype, is_hopper: bool) -> tuple[int, int, int, int]:
    return _PREFILL_TILES[is_hopper, dtype == torch.float32][_size_class(block_d)]


def decode_tiles(block_d: int, dtype: torch.dtype) -> tuple[int, int, int]:
    return _DECODE_TILES[dtype == torch.float32][_size_class(block_d)]


@functools.lru_cache(maxsize=None)
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def is_hopper(device: torch.device) -> bool:
    """sm_90 or newer; the interpreter (CPU) takes the Hopper tiles too."""
    if device.type != "cuda":
        return True
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9
