"""What LLMEngine logs once it is up: the model, its device and dtypes, the KV cache (how many
tokens, how its memory is held and what bounds it), the sampling defaults in force."""
import os
import resource

from nanovllm.config import Config
from nanovllm.engine.kv_groups import slots_per_block
from nanovllm.executor.abstract import Executor


def startup_summary(config: Config, runner: Executor, num_blocks: int) -> str:
    """What a user wants to know once the engine is up: the model, where and in which dtypes it
    runs, the memory taken, how many tokens the KV cache holds."""
    arch = (getattr(config.hf_config, "architectures", None) or ["?"])[0]
    dtypes = str(config.torch_dtype).removeprefix("torch.")
    if config.weight_dtype != config.torch_dtype:
        dtypes += f" activations, {str(config.weight_dtype).removeprefix('torch.')} weights"
    tp = f", {config.tensor_parallel_size} tensor-parallel ranks" if config.tensor_parallel_size > 1 else ""
    kv_bytes = num_blocks * runner.kv_block_bytes()
    tokens = kv_bytes // runner.kv_token_bytes()  # of every layer (engine/kv_groups.py: sliding groups hold fewer)
    kv_mib = kv_bytes / 2**20
    groups, kinds, layers = runner.kv_groups, "", ""
    if len(groups) > 1:  # engine/kv_groups.py
        layers = f" tokens x {slots_per_block(groups)} layers"
        windows = sorted({g.window for g in groups}, key=lambda w: w or 0)
        kinds = "; block tables: " + ", ".join(
            f"{sum(1 for g in groups if g.window == w)} of {'full' if w is None else f'window-{w}'} layers"
            for w in windows)
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return (f"model {os.path.basename(config.model.rstrip('/'))} ({arch}) on {config.device}{tp}, {dtypes}; "
            f"weights {runner.weight_bytes / 2**20:.0f} MiB held per rank; KV cache {tokens} tokens in {config.kv_format.name}, {runner.kv_token_bytes()} bytes per token "
            f"({num_blocks} blocks of {config.kvcache_block_size}{layers}{kinds}), {kv_mib:.0f} MiB per rank "
            f"{config.platform.kv_cache_holding(config.kvcache_prefault)}; "
            f"peak RSS {peak_rss_mib:.0f} MiB")


def sampling_defaults_line(config: Config) -> str:
    """Where the sampling defaults come from and what they mean for a request: a sampled default
    (a model card's temperature) makes the same question come back differently."""
    from nanovllm.utils.default_model import GENERATION_DIRNAME
    source = config.generation_config
    if source == "auto":
        source = "the model's generation config"
    elif os.path.basename(source.rstrip("/")) == GENERATION_DIRNAME:
        source = "the default model's card"
    else:
        source = f"generation_config {source!r}"
    if config.override_generation_config:
        source += " and override_generation_config"
    fields = ", ".join(f"{k}={v}" for k, v in config.sampling_defaults.items())
    line = f"sampling defaults from {source}: {fields}: requests that leave a field unset take it"
    if config.sampling_defaults.get("temperature", 1.0) > 0:
        line += "; send temperature=0 for a deterministic (greedy) answer"
    if config.max_tokens_ceiling is not None:
        line += f"; no request gets more than {config.max_tokens_ceiling} tokens"
    return line + " (generation_config='vllm' / --generation-config vllm: none)"
