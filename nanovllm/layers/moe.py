"""The fused-experts layer of a mixture of experts (FusedMoE): num_experts gated MLPs stacked per
layer, of which a router picks top_k per token; the token's output is their outputs weighted by the
router's softmax (renormalized over the chosen ones where the model says so). The model families'
blocks around it (router, shared expert, which layers are sparse) are in models/moe_block.py.

The experts' weights are stacked: w13 [E, 2 I, H] (each expert's gate rows, then its up rows) and
w2 [E, H, I]. Tensor parallelism splits every expert's intermediate dimension over the ranks (gate
and up rows, down columns); the partial outputs are summed by all_reduce.

How the experts run is the layer's method (layers/quantization, moe_method): tokens grouped by
expert, each active expert's weights read once per step: in C on a CPU (kernels/cpu_moe.c), by a
Triton kernel on CUDA (kernels/fused_moe.py), and by the grouped torch loop of
quantization/moe_ops.py elsewhere and as the reference of both."""
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from nanovllm.distributed.parallel import divide, get_tp_rank, get_tp_size
from nanovllm.layers.quantization.base import QuantizationConfig, method_for
from nanovllm.layers.quantization.parameter import TaggedWeights, copy_checked, shard_of


@dataclass(frozen=True)
class ExpertActivation:
    """The experts' activation of gate g and up u (moe_ops.activate): "silu", silu(g) u, or
    "swigluoai" (GPT-OSS), (clamp(u, -limit, limit) + 1) g' sigmoid(alpha g'), g' = min(g, limit)."""

    name: str = "silu"
    alpha: float = 0.0
    limit: float = 0.0

    def __post_init__(self):
        if self.name not in ("silu", "swigluoai"):
            raise ValueError(f"experts activation {self.name!r} is not supported (silu, swigluoai)")


class FusedMoE(TaggedWeights):
    """The experts of one layer: forward(x, router_logits) -> [T, hidden], summed over the ranks.
    bias: every expert's gate / up and down have biases (w13_bias [E, 2I], w2_bias [E, H], fp32;
    with tensor parallelism only rank 0 holds the down biases' values, so the sum adds them once).
    lora: the experts' adapter slots (lora/experts.py) when the engine serves adapters on them.
    grouped: DeepSeek-V3 / GLM-4.5's router (moe_ops.GroupedTopK; None: softmax top-k), with its
    e_score_correction_bias [num_experts] (fp32, every rank whole; the checkpoint names it beside the
    router's weight: the model's loader renames it)."""

    lora = None

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", bias: bool = False,
                 activation: ExpertActivation = ExpertActivation(), grouped=None):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"{prefix}: num_experts_per_tok ({top_k}) must be in [1, num_experts ({num_experts})]")
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        if grouped is not None and (num_experts % grouped.n_group or not 0 < grouped.topk_group <= grouped.n_group
                                    or top_k > grouped.topk_group * (num_experts // grouped.n_group)):
            raise ValueError(f"{prefix}: n_group {grouped.n_group} / topk_group {grouped.topk_group} do not split "
                             f"{num_experts} experts into groups leaving top_k {top_k} to choose from")
        self.grouped = grouped
        if grouped is not None:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                        requires_grad=False)
        self.hidden_size = hidden_size
        self.intermediate_size = divide(intermediate_size, self.tp_size, "moe_intermediate_size")
        self.prefix = prefix
        self.activation = activation
        self.quant_method = method_for(quant_config, "moe_method", self, prefix)
        self.quant_method.create_weights(self, num_experts, hidden_size, self.intermediate_size,
                                         torch.get_default_dtype())
        if bias:
            self.register_weight("w13_bias", torch.zeros(num_experts, 2 * self.intermediate_size, dtype=torch.float32),
                                 output_dim=1)
            self.register_weight("w2_bias", torch.zeros(num_experts, hidden_size, dtype=torch.float32), output_dim=1)
        else:
            self.w13_bias = self.w2_bias = None

    @property
    def biases(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(w13_bias, w2_bias) fp32, or None."""
        return None if self.w13_bias is None else (self.w13_bias, self.w2_bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int, expert_id: int) -> None:
        """Expert expert_id's gate (shard 0), up (1) or down (2) matrix or bias, this rank's part of it."""
        what = f"{self.prefix}.experts.{expert_id}[{('gate', 'up', 'down')[shard_id]}]"
        if param is self.w2_bias:
            copy_checked(param.data[expert_id], loaded if self.tp_rank == 0 else torch.zeros_like(loaded), what)
        elif shard_id == 2:
            part = shard_of(loaded, 1, self.tp_rank, self.tp_size, f"{what} input dimension")
            copy_checked(param.data[expert_id], part, what)
        else:
            part = shard_of(loaded, 0, self.tp_rank, self.tp_size, f"{what} output dimension")
            rows = self.intermediate_size
            copy_checked(param.data[expert_id].narrow(0, shard_id * rows, rows), part, what)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, router_logits)
        if self.lora is not None:
            y = self.lora.add(x, router_logits, y)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y
