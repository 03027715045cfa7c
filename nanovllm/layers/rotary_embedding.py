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


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, rotary_dim: int, max_position: int, base: float,
                 rope_scaling: dict | None = None):
        super().__init__()
        if rotary_dim != head_size:
            raise ValueError(f"partial rotary embedding is not supported (rotary_dim={rotary_dim}, "
                             f"head_dim={head_size})")
        self.head_size = head_size
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling, max_position)
        elif rope_type not in ("default", None):
            raise ValueError(f"rope scaling type {rope_type!r} is not supported "
                             "(supported: default, llama3)")
        t = torch.arange(max_position, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)
        # [max_position, 1, rotary_dim]: cos then sin, each rotary_dim // 2 wide
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).unsqueeze(1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        return apply_rotary_emb(query, cos, sin), apply_rotary_emb(key, cos, sin)


def rope_settings(hf_config) -> tuple[float, dict | None]:
    """(theta, scaling dict) from either the 4.x fields or the 5.x `rope_parameters` dict."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        theta = 10000.0
    scaling = getattr(hf_config, "rope_scaling", None)
    if params.get("rope_type", "default") != "default":
        scaling = params
    return float(theta), scaling


def get_rope(head_size: int, rotary_dim: int, max_position: int, base: float,
             rope_scaling: dict | None = None) -> RotaryEmbedding:
    return RotaryEmbedding(head_size, rotary_dim, max_position, base, rope_scaling)
