"""A block's bytes depend on more than its tokens: the weights, how activations and K/V are held, which
layers a block holds, the tensor-parallel shard and the positions' encoding. fingerprint() hashes all of
it; the tier keeps each fingerprint's blocks apart and checks every file against it, so a directory
written by another model, dtype or layout only ever misses."""
import json
import os

import xxhash

from nanovllm.loader.safetensors import safetensors_files

FORMAT_VERSION = 1
EDGE_BYTES = 1 << 20  # of each weight file: its size, its first and its last MiB

# The hf_config fields that change how positions rotate K (rope) or which tokens a layer sees.
ROPE_FIELDS = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "head_dim",
               "max_position_embeddings", "sliding_window", "layer_types")


def file_identity(path: str) -> list:
    """(name, size, xxh64 of the first and last EDGE_BYTES): cheap, and any rewritten checkpoint differs."""
    size = os.path.getsize(path)
    digest = xxhash.xxh64()
    with open(path, "rb") as f:
        digest.update(f.read(EDGE_BYTES))
        if size > EDGE_BYTES:
            f.seek(max(EDGE_BYTES, size - EDGE_BYTES))
            digest.update(f.read(EDGE_BYTES))
    return [os.path.basename(path), size, digest.hexdigest()]


def weight_files(checkpoint) -> list[str]:
    """A GGUF file, or a folder's safetensors files and their index."""
    if checkpoint.is_gguf:
        return [checkpoint.path]
    index = os.path.join(checkpoint.path, "model.safetensors.index.json")
    return safetensors_files(checkpoint.path) + ([index] if os.path.isfile(index) else [])


def fingerprint(config, kv_groups: list, block_bytes: int, tp_rank: int = 0) -> str:
    """Hex digest of everything besides the tokens that makes a block's K/V bytes."""
    hf = config.hf_config
    parts = {
        "version": FORMAT_VERSION,
        "weights": [file_identity(p) for p in weight_files(config.checkpoint)],
        "architecture": config.model_class.__name__,
        "quantization": [config.quantization, str(config.cpu_input_bits), type(config.quant_config).__name__],
        "dtype": [str(config.torch_dtype), str(config.weight_dtype)],
        "kv_format": config.kv_format.name,
        "block_size": config.kvcache_block_size,
        "block_bytes": block_bytes,
        "kv_groups": [[group.window, list(group.layers)] for group in kv_groups],
        "tensor_parallel": [tp_rank, config.tensor_parallel_size],
        "rope": {name: getattr(hf, name, None) for name in ROPE_FIELDS},
    }
    return xxhash.xxh3_128(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
