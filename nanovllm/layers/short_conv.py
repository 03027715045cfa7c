"""LFM2's gated short convolution: in_proj gives B, C and x per channel; the product B * x runs
through a depthwise causal convolution of conv_L_cache taps (no activation), is gated by C and
projected back:

    y_t = out_proj(C_t * sum_j w_j (B * x)_{t - L + 1 + j})

A sequence's last L - 1 products B * x live in a state slot of its own (layers/sequence_state.py),
so decode reads a fixed size per sequence however long it is. Tensor parallelism splits the
channels: each rank its B, C and x rows of in_proj, the matching conv taps, and out_proj's inputs."""
import ctypes

import torch
from torch import nn

from nanovllm.distributed.parallel import get_tp_rank, get_tp_size
from nanovllm.kernels.cpu_structs import Linear, ShortConvLayer
from nanovllm.layers.c_description import CDescriber, CPart, NotInC, describes
from nanovllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from nanovllm.layers.sequence_state import SequenceStateLayer, causal_conv, causal_conv_step
from nanovllm.utils.context import get_context


class ShortConv(SequenceStateLayer):
    """Checkpoint names (LFM2): in_proj [3 x hidden, hidden] (B, C, x stacked: shards 0-2 here),
    conv.weight [hidden, 1, L] (and conv.bias where conv_bias), out_proj."""

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        hidden, tp = config.hidden_size, get_tp_size()
        if hidden % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the short convolution's {hidden} channels")
        self.kernel = int(config.conv_L_cache)
        if not 2 <= self.kernel <= 8:
            raise ValueError(f"conv_L_cache is {self.kernel}; the short convolution takes 2..8 taps")
        self.channels = hidden // tp  # this rank's
        bias = bool(getattr(config, "conv_bias", False))
        self.in_proj = MergedColumnParallelLinear(hidden, [hidden] * 3, bias=bias, quant_config=quant_config,
                                                  prefix=f"{prefix}.in_proj")
        self.conv = nn.Module()
        self.conv.weight = nn.Parameter(torch.empty(self.channels, 1, self.kernel), requires_grad=False)
        self.conv.weight.weight_loader = self._load_channels
        self.conv.bias = None
        if bias:
            self.conv.bias = nn.Parameter(torch.empty(self.channels), requires_grad=False)
            self.conv.bias.weight_loader = self._load_channels
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias, quant_config=quant_config,
                                          prefix=f"{prefix}.out_proj")
        self.state: torch.Tensor | None = None  # [slots, channels, L - 1] fp32, set by attach_state
        self.c_kernels = None
        self.c_desc: ShortConvLayer | None = None
        self.c_conv: torch.Tensor | None = None  # the taps as c_desc points into them

    def _load_channels(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        tp = get_tp_size()
        if loaded.shape[0] != self.channels * tp or loaded.numel() != param.numel() * tp:
            raise ValueError(f"the short convolution's {tuple(loaded.shape)} does not hold {self.channels * tp} "
                             f"channels of {self.kernel} taps")
        param.data.copy_(loaded.chunk(tp)[get_tp_rank()].reshape(param.shape))

    def slot_bytes(self) -> int:
        return 4 * self.channels * (self.kernel - 1)

    def new_state(self, slots: int, device) -> torch.Tensor:
        return torch.zeros(slots, self.channels, self.kernel - 1, device=device)

    def attach_state(self, state: torch.Tensor, c_kernels=None, use_triton: bool = False) -> None:
        """The slots this layer's steps read; with c_kernels (the CPU's), its taps and state described
        once for the C one-call decode step (executor/cpu_decode.py)."""
        self.state, self.c_kernels, self.c_desc = state, c_kernels, None
        if c_kernels is None:
            return
        self.c_conv = self.taps().contiguous()
        bias = self.conv.bias
        if bias is not None and bias.dtype != torch.float32:
            raise ValueError("the C kernels read the short convolution's bias as fp32")
        self.c_desc = ShortConvLayer(self.c_conv.data_ptr(), 0 if bias is None else bias.data_ptr(),
                                     state.data_ptr(), self.channels, self.kernel)

    def taps(self) -> torch.Tensor:
        return self.conv.weight.squeeze(1).float()  # [channels, L]

    def bias(self) -> torch.Tensor | None:
        return None if self.conv.bias is None else self.conv.bias.float()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, c, x = self.in_proj(hidden_states).float().chunk(3, dim=-1)
        bx = b * x
        batch = get_context().state
        if batch is None:  # outside the engine's steps: the rows are one sequence
            conv, _ = causal_conv(bx.new_zeros(self.channels, self.kernel - 1), bx.t(), self.taps(), self.bias())
            conv = conv.t()
        elif not get_context().is_prefill:
            conv, history = causal_conv_step(self.state.index_select(0, batch.slots), bx, self.taps(), self.bias())
            self.state.index_copy_(0, batch.slots, history)
        else:
            conv = torch.cat(list(self.run_sequences(bx, batch)))
        return self.out_proj((c * conv).to(hidden_states.dtype))

    def run_sequences(self, bx: torch.Tensor, batch):
        """Each sequence's rows of a prefill step from its slot (zero when fresh or without one),
        which it leaves holding its last L - 1 products."""
        start = 0
        slots = batch.slots.tolist() if batch.slots is not None else [None] * len(batch.query_lens)
        for slot, n, fresh in zip(slots, batch.query_lens, batch.fresh):
            rows = bx[start:start + n].t()
            start += n
            history = rows.new_zeros(self.channels, self.kernel - 1) if slot is None or fresh else self.state[slot]
            out, history = causal_conv(history, rows, self.taps(), self.bias())
            if slot is not None:
                self.state[slot] = history
            yield out.t()


@describes(ShortConv)
def _c_short_conv(conv: ShortConv, c: CDescriber) -> CPart:
    """Its taps and state as attach_state described them, in_proj and out_proj in the places of an
    attention layer's qkv and o; the one C call only (no phases of its own)."""
    if conv.c_desc is None:
        raise NotInC("it has no C description (no state slots for the C kernels)")
    qkv, o = c.linear(conv.in_proj, "its in_proj"), c.linear(conv.out_proj, "its out_proj")
    return CPart({"qkv": qkv or Linear(), "o": o or Linear(), "short_conv": ctypes.pointer(conv.c_desc)},
                 in_c=qkv is not None and o is not None, one_call_only=True)
