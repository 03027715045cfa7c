"""GPT-OSS (GptOssForCausalLM): attention with biases, a learned sink logit per head and sliding-window
layers alternating with full ones (`layer_types`), YaRN rope; a mixture of experts in every layer
whose router has a bias and takes the softmax over its top-k logits (the softmax over all of them
renormalized over the k: the same weights), and whose experts have biases and a clamped SwiGLU:
(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).

The experts are the shared fused-experts layer (layers/moe.py) with biases and that activation, so
every experts method runs them: dense (bf16 / fp32 checkpoints), MXFP4 as OpenAI ships them
(layers/quantization/mxfp4.py, the C MXFP4 kernel), a GGUF file's formats, `quantization=` at load.
The checkpoint stacks each layer's experts with gate and up interleaved (gate_up_proj [E, H, 2I],
columns gate 0, up 0, gate 1, ...; MXFP4: rows of gate_up_proj_blocks / _scales likewise); they
are handed to the layer expert by expert, gate and up apart, as Qwen-MoE checkpoints name them.
"""
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.layers.moe import ExpertActivation, FusedMoE
from nanovllm.layers.quantization.base import QuantizationConfig
from nanovllm.layers.quantization.mxfp4 import BLOCKS, SCALES, gguf_rows
from nanovllm.loader.weights import StackedParam
from nanovllm.models.decoder import DecoderForCausalLM
from nanovllm.layers.c_description import describes
from nanovllm.models.moe_block import EXPERT_PARTS, SparseMoeBlock, describe_moe_block, expert_stacked_params


# The checkpoint's stacked expert tensors (dense, biases, MXFP4 halves).
STACKED = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


class GptOssMoE(SparseMoeBlock):
    """The sparse block with GPT-OSS's router (`gate` here, `router` in the checkpoint: a bias), and
    experts with biases and the clamped SwiGLU; no shared expert. As a SparseMoeBlock the C decode
    step runs it (its experts kernel has the biases and the activation)."""

    def __init__(self, config, prefix: str, quant_config: QuantizationConfig | None):
        nn.Module.__init__(self)
        self.gate = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=True, prefix=f"{prefix}.router")
        self.experts = FusedMoE(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                                config.intermediate_size, True, quant_config, f"{prefix}.experts", bias=True,
                                activation=ExpertActivation("swigluoai", config.swiglu_alpha, config.swiglu_limit))
        self.shared_expert = self.shared_expert_gate = None


describes(GptOssMoE)(describe_moe_block)  # its experts kernel has the biases and the activation


def split_experts(name: str, tensor: torch.Tensor, rows: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """One stacked expert tensor (experts.gate_up_proj / down_proj, their _bias; rows: MXFP4 rows
    [E, outputs, bytes] made of a _blocks / _scales pair, already output-major) as the per-expert
    names of EXPERT_PARTS: experts.{e}.gate_proj / up_proj / down_proj .weight / .bias."""
    base, kind = name.rsplit(".", 1)
    proj = kind.removesuffix("_bias")
    suffix = "bias" if kind.endswith("_bias") else "weight"
    for e in range(tensor.shape[0]):
        outputs = tensor[e] if rows or suffix == "bias" else tensor[e].t()  # dense: [inputs, outputs]
        if proj == "down_proj":
            yield f"{base}.{e}.down_proj.{suffix}", outputs
        else:  # gate and up interleaved: even outputs gate, odd up
            yield f"{base}.{e}.gate_proj.{suffix}", outputs[0::2]
            yield f"{base}.{e}.up_proj.{suffix}", outputs[1::2]


class GptOssForCausalLM(DecoderForCausalLM):
    def __init__(self, config, quant_config: QuantizationConfig | None = None):
        super().__init__(config, quant_config)
        for layer in self.model.layers:
            layer.self_attn.attn.enable_sinks()

    def make_mlp(self, config, layer_idx: int, prefix: str, quant_config) -> nn.Module:
        return GptOssMoE(config, prefix, quant_config)

    def stacked_params(self) -> list[StackedParam]:
        n = self.model.layers[0].mlp.experts.num_experts
        biases = [StackedParam(f"experts.{param.replace('weight', 'bias')}", f"experts.{e}.{part}.bias", shard, e)
                  for e in range(n) for part, (param, shard) in EXPERT_PARTS.items()]
        return expert_stacked_params(n) + biases + super().stacked_params()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def renamed():
            pending: dict[str, torch.Tensor] = {}  # an MXFP4 matrix's blocks or scales, until its other half
            for name, tensor in weights:
                name = name.replace(".self_attn.sinks", ".self_attn.attn.sinks").replace(".mlp.router.", ".mlp.gate.")
                if not STACKED.search(name):  # (a GGUF file's experts come one by one already)
                    yield name, tensor
                    continue
                if name.endswith(BLOCKS) or name.endswith(SCALES):
                    stem = name[: -len(BLOCKS)]
                    other = stem + (SCALES if name.endswith(BLOCKS) else BLOCKS)
                    if other not in pending:
                        pending[name] = tensor
                        continue
                    blocks, scales = (tensor, pending.pop(other)) if name.endswith(BLOCKS) else (pending.pop(other), tensor)
                    yield from split_experts(stem, gguf_rows(blocks, scales, stem), rows=True)
                else:
                    yield from split_experts(name, tensor)
            if pending:
                raise ValueError(f"MXFP4 tensors without their other half: {sorted(pending)}")
        super().load_weights(renamed())
