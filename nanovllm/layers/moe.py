"""Sparse mixture-of-experts block (Qwen3-MoE, Qwen2-MoE, Mixtral): a router picks top_k of
num_experts gated MLPs per token; the token's output is their outputs weighted by the router's
softmax (renormalized over the chosen ones where the model says so), plus, for Qwen2-MoE, a shared
expert scaled by a sigmoid gate.

The experts' weights are stacked per layer: w13 [E, 2 I, H] (each expert's gate rows, then its up
rows) and w2 [E, H, I], loaded from the hub's per-expert tensors (experts.{e}.gate_proj / up_proj /
down_proj). Tensor parallelism splits every expert's intermediate dimension over the ranks (gate and
up rows, down columns), the router replicated; the partial outputs are summed by all_reduce.

How the experts run is FusedMoE's method (layers/quantization, moe_method_for): tokens grouped by
expert, each active expert's weights read once per step: in C on a CPU (kernels/cpu_moe.c), by a
Triton kernel on CUDA (kernels/fused_moe.py), and by the grouped torch loop of experts_reference
elsewhere and as the reference of both."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed.parallel import divide, get_tp_rank, get_tp_size
from nanovllm.kernels import cpu_kernels
from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.layers.quantization import FusedMoEMethodBase, LinearKernels, QuantizationConfig, moe_method_for
from nanovllm.layers.quantization.parameter import TaggedWeights, copy_checked, shard_of
from nanovllm.layers.quantization.unquantized import dense_c_view
from nanovllm.loader.weights import StackedParam

# Checkpoint names of an expert's three matrices, as (stacked parameter, shard id): the hub's
# Qwen-MoE names and Mixtral's w1 (gate) / w3 (up) / w2 (down).
EXPERT_PARTS = {"gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1), "down_proj": ("w2_weight", 2)}
MIXTRAL_EXPERT_PARTS = {"w1": ("w13_weight", 0), "w3": ("w13_weight", 1), "w2": ("w2_weight", 2)}


def expert_stacked_params(num_experts: int, parts: dict = EXPERT_PARTS) -> list[StackedParam]:
    """The loader's entries for experts.{e}.{part}.weight -> experts.{w13,w2}_weight, part shard_id of expert e."""
    return [StackedParam(f"experts.{param}", f"experts.{e}.{part}.weight", shard_id, e)
            for e in range(num_experts) for part, (param, shard_id) in parts.items()]


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, top_k], expert ids int64 [T, top_k]) of each token: the top_k of the
    router's softmax (computed in fp32), divided by their sum when renormalize."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t, expert e's MLP being
    w2[e] (silu(gate) * up) with gate | up = w13[e] x: tokens grouped by expert, each expert that
    receives a token run once over its tokens."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // ids.shape[1]
        gate, up = F.linear(x[tokens], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]).float()
        out.index_add_(0, tokens, y * weights.flatten()[pairs, None])
    return out.to(x.dtype)


class FusedMoE(TaggedWeights):
    """The experts of one layer: forward(x, router_logits) -> [T, hidden], summed over the ranks."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"{prefix}: num_experts_per_tok ({top_k}) must be in [1, num_experts ({num_experts})]")
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size = hidden_size
        self.intermediate_size = divide(intermediate_size, self.tp_size, "moe_intermediate_size")
        self.prefix = prefix
        self.quant_method = moe_method_for(quant_config, self, prefix)
        self.quant_method.create_weights(self, num_experts, hidden_size, self.intermediate_size,
                                         torch.get_default_dtype())

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int, expert_id: int) -> None:
        """Expert expert_id's gate (shard 0), up (1) or down (2) matrix, this rank's part of it."""
        what = f"{self.prefix}.experts.{expert_id}[{('gate', 'up', 'down')[shard_id]}]"
        if shard_id == 2:
            part = shard_of(loaded, 1, self.tp_rank, self.tp_size, f"{what} input dimension")
            copy_checked(param.data[expert_id], part, what)
        else:
            part = shard_of(loaded, 0, self.tp_rank, self.tp_size, f"{what} output dimension")
            rows = self.intermediate_size
            copy_checked(param.data[expert_id].narrow(0, shard_id * rows, rows), part, what)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, router_logits)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y


class SparseMoeBlock(nn.Module):
    """gate (the router, replicated and dense), experts, and optionally a shared expert with its
    sigmoid gate (Qwen2-MoE); names as in the hub checkpoints."""

    def __init__(self, config, prefix: str, quant_config: QuantizationConfig | None, renormalize: bool,
                 shared_expert_size: int = 0):
        super().__init__()
        from nanovllm.models.decoder import GatedMLP
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


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """Dense experts in the model dtype: the C experts kernel on a CPU that has the C kernels
    (kernels/cpu_moe.c: fp32 weights, or bf16 when the platform holds them so), the Triton
    kernel on CUDA, the grouped torch loop otherwise. One copy of the weights, read by whichever."""

    name = "dense experts"

    def __init__(self):
        self.c_kernels = None
        self.c_moe = None  # kernels/cpu_kernels.py, MoeExperts over the stacked weights

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int,
                       params_dtype: torch.dtype) -> None:
        layer.register_weight("w13_weight", torch.empty(num_experts, 2 * intermediate_size, hidden_size,
                                                        dtype=params_dtype), output_dim=1, input_dim=2)
        layer.register_weight("w2_weight", torch.empty(num_experts, hidden_size, intermediate_size,
                                                       dtype=params_dtype), output_dim=1, input_dim=2)

    def process_weights_after_loading(self, layer: nn.Module, kernels: LinearKernels, is_shared: bool) -> None:
        if kernels.c_kernels is None or layer.w13_weight.device.type != "cpu":
            return
        for param in (layer.w13_weight, layer.w2_weight):
            param.data = param.data.to(kernels.c_weight_dtype).contiguous()
        views = [[dense_c_view(w[e]) for e in range(layer.num_experts)] for w in (layer.w13_weight, layer.w2_weight)]
        self.c_kernels = kernels.c_kernels
        self.c_moe = cpu_kernels.moe_experts_struct(self.c_kernels, views[0], views[1], layer.top_k,
                                                    layer.renormalize)

    def apply(self, layer: nn.Module, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if self.c_moe is not None and x.dtype == torch.float32:
            return cpu_kernels.moe_experts(self.c_kernels, self.c_moe, x, router_logits)
        weights, ids = select_experts(router_logits, layer.top_k, layer.renormalize)
        if x.is_cuda:
            from nanovllm.kernels.fused_moe import fused_experts
            return fused_experts(x, layer.w13_weight, layer.w2_weight, weights, ids)
        return experts_reference(x, layer.w13_weight, layer.w2_weight, weights, ids)

    @property
    def c_only(self) -> bool:
        return self.c_moe is not None

    def c_struct(self, layer: nn.Module):
        return self.c_moe

    def streamed_weights(self, layer: nn.Module) -> list[torch.Tensor]:
        return [layer.w13_weight, layer.w2_weight]
