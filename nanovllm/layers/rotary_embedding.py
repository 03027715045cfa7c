"""Rotary position embedding (neox style, as HF Qwen/Llama), with a cos/sin cache built once."""
import math

import torch
from torch import nn


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, num_heads, rotary_dim]; cos/sin: [num_tokens, 1, rotary_dim // 2]
    x1, x2 = x.float().chunk(2, dim=-1)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    return torch.cat((y1, y2), dim=-1).to(x.dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict, max_position: int) -> torch.Tensor:
    """Llama-3.x frequency scaling: long wavelengths slowed by `factor`, short ones kept, the band
    between blended smoothly. Missing original_max_position_embeddings falls back to the model's
    max_position_embeddings, as transformers does."""
    if "factor" not in scaling:
        raise ValueError(f"llama3 rope scaling needs a 'factor', got {scaling!r}")
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings") or max_position
    low_wavelen = old_len / low_freq_factor
    high_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, scaling: dict, rotary_dim: int, base: float,
                   max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023) as transformers computes it: per frequency, a blend of the original
    (extrapolated) and the `factor`-slowed (interpolated) one, by a linear ramp over the dimensions
    between those that turn beta_fast and beta_slow times within the original context; and the
    attention factor cos and sin are multiplied by (0.1 ln(factor) + 1 unless given, or DeepSeek's
    mscale ratio). Missing original_max_position_embeddings falls back to max_position."""
    factor = scaling.get("factor")
    if not factor:
        raise ValueError(f"yarn rope scaling needs a 'factor', got {scaling!r}")
    original = scaling.get("original_max_position_embeddings") or max_position

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in `original`
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp  # the share of each frequency kept as it was
    return inv_freq / factor * (1 - extrapolated) + inv_freq * extrapolated, float(attention_factor)


SCALED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type_of(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type")) or "default"


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, rotary_dim: int, max_position: int, base: float,
                 rope_scaling: dict | None = None):
        super().__init__()
        if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and in (0, head_dim={head_size}]")
        self.head_size = head_size
        # Partial rotary (Qwen3-Next, Qwen3.5: a quarter of each head): the first rotary_dim dims of
        # each head are rotated, the rest pass through.
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        rope_type, attention_factor = rope_type_of(rope_scaling), 1.0
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling, max_position)
        elif rope_type == "yarn":
            inv_freq, attention_factor = _yarn_inv_freq(inv_freq, rope_scaling, rotary_dim, base, max_position)
        elif rope_type == "linear":
            inv_freq = inv_freq / rope_scaling["factor"]
        elif rope_type != "default":
            raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(SCALED_ROPE_TYPES)})")
        positions = rope_positions(max_position, rope_scaling)
        t = torch.arange(positions, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)
        # [positions, 1, rotary_dim]: cos then sin, each rotary_dim // 2 wide, times YaRN's attention
        # factor (1 otherwise), so every path that reads the cache (the C decode too) applies it
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).unsqueeze(1) * attention_factor
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        if self.rotary_dim == self.head_size:
            return apply_rotary_emb(query, cos, sin), apply_rotary_emb(key, cos, sin)
        r = self.rotary_dim
        return tuple(torch.cat((apply_rotary_emb(x[..., :r], cos, sin), x[..., r:]), dim=-1) for x in (query, key))


def rope_settings(hf_config, layer_type: str | None = None) -> tuple[float, dict | None]:
    """(theta, scaling dict) from either the 4.x fields or the 5.x `rope_parameters` dict (with
    layer_type, its entry for that kind of layer: Gemma 3 gives sliding layers their own)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params.get(layer_type) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        theta = 10000.0
    scaling = getattr(hf_config, "rope_scaling", None)
    if params.get("rope_type", "default") != "default":
        scaling = params
    return float(theta), scaling


def rope_positions(max_position_embeddings: int, scaling: dict | None) -> int:
    """The positions a scaled rope reaches (what max_model_len may be): YaRN's original context
    times its factor, linear scaling's positions times its factor (vLLM's rule); the model's
    max_position_embeddings otherwise."""
    rope_type, factor = rope_type_of(scaling), (scaling or {}).get("factor") or 1.0
    if rope_type == "yarn":
        original = scaling.get("original_max_position_embeddings") or max_position_embeddings
        return max(max_position_embeddings, int(original * factor))
    if rope_type == "linear":
        return int(max_position_embeddings * factor)
    return max_position_embeddings


def get_rope(head_size: int, rotary_dim: int, max_position: int, base: float,
             rope_scaling: dict | None = None) -> RotaryEmbedding:
    return RotaryEmbedding(head_size, rotary_dim, max_position, base, rope_scaling)
