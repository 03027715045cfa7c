"""LoRA on a mixture of experts' experts: PEFT's `target_parameters` on the stacked `gate_up_proj` and
`down_proj` of a transformers MoE block, each expert with its own low-rank update of its gate|up and
down matrices. A FusedMoE layer's `lora` seat holds them per slot; rows whose adapter has such
updates run their experts through the grouped torch loop with each chosen expert's update added
(the other rows keep the layer's own method). The experts must be held dense (an HF checkpoint's
fp32 / bf16 weights): adapters on quantized experts are refused when read.

Tensor parallelism splits every expert's intermediate dimension: gate|up updates take their rank's
rows of B, down updates their rank's columns of A, and the layer's all-reduce sums the partial
outputs as it sums the base ones."""
import torch

from nanovllm.layers.quantization.moe_ops import experts_reference, route
from nanovllm.lora.adapter import EXPERT_PARTS
from nanovllm.utils.context import get_context


def has_dense_experts(layer) -> bool:
    return isinstance(getattr(layer, "w13_weight", None), torch.Tensor) and layer.w13_weight.is_floating_point()


class ExpertsLoRA:
    """A FusedMoE layer's adapter slots: per slot and expert, gate|up's A [r, hidden] and B [2I, r]
    and down's A [r, I] and B [hidden, r] (this rank's shares, the scale folded into B, ranks
    zero-padded to max_rank), allocated when a first adapter touches the layer."""

    def __init__(self, layer, max_loras: int, max_rank: int):
        self.layer, self.max_loras, self.rank = layer, max_loras, max_rank
        self.w: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.filled = [False] * max_loras

    def _allocate(self, dtype: torch.dtype, device) -> None:
        layer, slots, r = self.layer, self.max_loras, self.rank
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size

        def zeros(*shape):
            return torch.zeros(*shape, dtype=dtype, device=device)
        self.w = {"gate_up_proj": (zeros(slots, e, r, h), zeros(slots, e, 2 * i, r)),
                  "down_proj": (zeros(slots, e, r, i), zeros(slots, e, h, r))}

    @property
    def allocated(self) -> bool:
        return self.w is not None

    def clear(self, slot: int) -> None:
        if self.w is not None and self.filled[slot]:
            for a, b in self.w.values():
                a[slot].zero_()
                b[slot].zero_()
        self.filled[slot] = False

    def fill(self, slot: int, index: int, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, device) -> None:
        """Slot's gate_up_proj (index 0) or down_proj (1) from the full A [E, r, in] and B [E, out, r],
        split as the layer is (gate|up: the rank's gate rows and up rows; down: its input columns)."""
        layer, r, part = self.layer, a.shape[1], EXPERT_PARTS[index]
        if self.w is None:  # (int8 slots are the C step's; the experts' grouped torch loop reads fp32 ones)
            self._allocate(torch.float32 if dtype == torch.int8 else dtype, device)
        if layer.tp_size > 1:
            if part == "gate_up_proj":
                gate, up = b.chunk(2, dim=1)
                b = torch.cat([gate.chunk(layer.tp_size, dim=1)[layer.tp_rank],
                               up.chunk(layer.tp_size, dim=1)[layer.tp_rank]], dim=1)
            else:
                a = a.chunk(layer.tp_size, dim=2)[layer.tp_rank]
        wa, wb = self.w[part]
        wa[slot, :, :r].copy_(a)
        wb[slot, :, :, :r].copy_(b)
        self.filled[slot] = True

    def add(self, x: torch.Tensor, router_logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the layer's method's output) with each adapter row's experts rerun with their updates."""
        batch = get_context().lora
        if batch is None or self.w is None:
            return y
        for slot, rows in batch.groups:
            if self.filled[slot]:
                y[rows] = self.experts(x[rows], router_logits[rows], slot)
        return y

    def experts(self, x: torch.Tensor, router_logits: torch.Tensor, slot: int) -> torch.Tensor:
        """The experts of x's rows under slot's updates (moe_ops.experts_reference's grouped loop)."""
        layer = self.layer
        weights, ids = route(layer, router_logits)
        lora = tuple(t[slot].to(x.dtype) for pair in self.w.values() for t in pair)
        return experts_reference(x, layer.w13_weight, layer.w2_weight, weights, ids, layer.biases, layer.activation,
                                 lora)
