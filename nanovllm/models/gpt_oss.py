"""GPT-OSS (GptOssForCausalLM): attention with biases, a learned sink logit per head and sliding-window
layers alternating with full ones (`layer_types`), YaRN rope; a mixture of experts in every layer
whose router has a bias and takes the softmax over its top-k logits, and whose experts hold gate
and up interleaved in one matrix with biases and a clamped SwiGLU:
(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).

The experts here are the checkpoint's dense (bf16 / fp32) matrices multiplied expert by expert in
torch, held whole on every tensor-parallel rank; MXFP4 experts and a fused kernel are not built yet.
"""
from collections.abc import Iterable

import torch
from torch import nn

from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.layers.quantization.base import QuantizationConfig
from nanovllm.models.decoder import DecoderForCausalLM


class GptOssExperts(nn.Module):
    """Experts [E] of hidden H and intermediate I: gate_up_proj [E, H, 2I] (gate and up interleaved
    along the last axis), gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias [E, H]."""

    def __init__(self, config):
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, i, h), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(e, h), requires_grad=False)
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; experts / weights [T, k]: each token's chosen experts and their weights."""
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            tokens, slot = torch.where(experts == e)
            y = self.activation(x[tokens] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e])
            y = (y @ self.down_proj[e] + self.down_proj_bias[e]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(x.dtype))
        return out


class GptOssMoE(nn.Module):
    def __init__(self, config, prefix: str):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=True,
                                       prefix=f"{prefix}.router")
        self.experts = GptOssExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return self.experts(x, experts, torch.softmax(top, dim=-1))


class GptOssForCausalLM(DecoderForCausalLM):
    fused_decode = False  # the C decode step knows the shared gated MLP only

    def __init__(self, config, quant_config: QuantizationConfig | None = None):
        if quant_config is not None and quant_config.name != "unquantized":
            raise ValueError(f"GPT-OSS runs from dense weights only so far, not {quant_config.name} "
                             "(MXFP4 and quantizing at load are not built)")
        super().__init__(config, quant_config)
        for layer in self.model.layers:
            layer.self_attn.attn.enable_sinks()

    def make_mlp(self, config, layer_idx: int, prefix: str, quant_config) -> nn.Module:
        return GptOssMoE(config, prefix)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def renamed():
            for name, tensor in weights:
                if name.endswith(".quantization_config") or "_blocks" in name or "_scales" in name:
                    raise ValueError(f"{name}: MXFP4 expert weights are not supported yet; use a dequantized "
                                     "(bf16) GPT-OSS checkpoint")
                yield name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), tensor
        super().load_weights(renamed())
