"""The sparse MoE blocks of the model families (Qwen3-MoE, Qwen2-MoE, Mixtral) around the fused
experts layer (layers/moe.py): the router (a replicated dense linear), the experts, Qwen2-MoE's
shared expert with its sigmoid gate; the families' config names and their rule of which layers
are sparse; the checkpoint names of the experts' matrices."""
import ctypes

import torch
from torch import nn

from nanovllm.kernels.cpu_structs import Linear, MoeExperts
from nanovllm.layers.c_description import CDescriber, CPart, NotInC, Phases, describes
from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.layers.moe import FusedMoE
from nanovllm.layers.quantization.base import QuantizationConfig
from nanovllm.loader.weights import StackedParam
from nanovllm.models.decoder import GatedMLP

# Checkpoint names of an expert's three matrices, as (stacked parameter, shard id): the hub's
# Qwen-MoE names and Mixtral's w1 (gate) / w3 (up) / w2 (down).
EXPERT_PARTS = {"gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1), "down_proj": ("w2_weight", 2)}
MIXTRAL_EXPERT_PARTS = {"w1": ("w13_weight", 0), "w3": ("w13_weight", 1), "w2": ("w2_weight", 2)}


def expert_stacked_params(num_experts: int, parts: dict = EXPERT_PARTS) -> list[StackedParam]:
    """The loader's entries for experts.{e}.{part}.weight -> experts.{w13,w2}_weight, part shard_id of expert e."""
    return [StackedParam(f"experts.{param}", f"experts.{e}.{part}.weight", shard_id, e)
            for e in range(num_experts) for part, (param, shard_id) in parts.items()]


class SparseMoeBlock(nn.Module):
    """gate (the router, replicated and dense), experts, and optionally a shared expert with its
    sigmoid gate (Qwen2-MoE); names as in the hub checkpoints."""

    def __init__(self, config, prefix: str, quant_config: QuantizationConfig | None, renormalize: bool,
                 shared_expert_size: int = 0):
        super().__init__()
        num_experts = moe_num_experts(config)
        self.gate = ReplicatedLinear(config.hidden_size, num_experts, bias=False, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(num_experts, config.num_experts_per_tok, config.hidden_size,
                                moe_intermediate_size(config), renormalize, quant_config, f"{prefix}.experts")
        self.shared_expert = self.shared_expert_gate = None
        if shared_expert_size:
            self.shared_expert = GatedMLP(config, quant_config, f"{prefix}.shared_expert", shared_expert_size)
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, bias=False,
                                                       prefix=f"{prefix}.shared_expert_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


def moe_num_experts(config) -> int:
    """num_experts (Qwen) or num_local_experts (Mixtral)."""
    n = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not n:
        raise ValueError("the config gives neither num_experts nor num_local_experts")
    return int(n)


def moe_intermediate_size(config) -> int:
    """Each expert's intermediate size: moe_intermediate_size (Qwen), or intermediate_size (Mixtral)."""
    return int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)


# Router options of other MoE families (DeepSeek, GLM-4.5, ...) that change what the router
# computes, with the value under which the plain softmax top-k router is what they ask for.
_ROUTER_DEFAULTS = {"scoring_func": "softmax", "topk_method": "greedy", "n_group": 1, "topk_group": 1,
                    "routed_scaling_factor": 1.0, "n_shared_experts": 0, "e_score_correction_bias": None}


def check_router_options(config) -> None:
    """ValueError naming a router option the block does not compute (a value other than the plain
    softmax top-k router's)."""
    for key, plain in _ROUTER_DEFAULTS.items():
        value = getattr(config, key, plain)
        if value is not None and value != plain:
            raise ValueError(f"MoE router option {key}={value!r} is not supported (the block computes a softmax "
                             f"top-k router: {key}={plain!r})")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"the experts' hidden_act {act!r} is not supported (only 'silu')")


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Qwen-MoE's rule: a layer is sparse unless listed in mlp_only_layers, every
    decoder_sparse_step-th layer (1: all)."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    only_mlp = set(getattr(config, "mlp_only_layers", None) or [])
    return moe_num_experts(config) > 0 and layer_idx not in only_mlp and (layer_idx + 1) % step == 0


def describe_moe_block(block: SparseMoeBlock, c: CDescriber) -> CPart:
    return describe_experts_block(block, block.experts, block.gate, block.shared_expert, block.shared_expert_gate, c)


def describe_experts_block(block: nn.Module, experts: FusedMoE, gate: nn.Module, shared: nn.Module | None,
                           shared_gate: nn.Module | None, c: CDescriber) -> CPart:
    """To the C decode step: a MoE block (its experts, router gate, shared expert MLP and that one's
    gate, each optional but the first two) as its experts' method's description with the router and
    the shared expert filled in, the layer's `moe` (not in C where a part has no view: the block then
    runs whole)."""
    described_experts = experts.quant_method.c_struct(experts)
    parts = [("gate", gate)]
    if shared is not None:
        parts += [("shared expert's gate_up_proj", shared.gate_up_proj), ("shared expert's down_proj", shared.down_proj)]
        parts += [("shared expert's gate", shared_gate)] if shared_gate is not None else []
    described = [c.linear(m, f"its {name}") for name, m in parts]
    if described_experts is None or any(d is None for d in described):
        return CPart(in_c=False, phases=Phases(mlp=block))
    moe = MoeExperts.from_buffer_copy(described_experts)
    moe.router = described[0]
    if shared is not None:
        moe.shared_gate_up, moe.shared_down = described[1:3]
        moe.shared_gate = described[3] if shared_gate is not None else Linear()
    c.kept.append(described_experts)  # the copy's expert arrays and chained parts live in the original
    if not c.kernels.moe_is_valid(ctypes.byref(moe)):
        raise NotInC("its C description is not valid")
    return CPart({"moe": c.struct_pointer(moe), "gate_up": Linear(), "down": Linear()}, phases=Phases(mlp=block))


describes(SparseMoeBlock)(describe_moe_block)
