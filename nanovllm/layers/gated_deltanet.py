"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): a short causal convolution over q/k/v,
then per value head a d_k x d_v state S that every token decays and corrects (the gated delta rule):

    S <- exp(g_t) S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T        o_t = S^T q_t

with q and k L2-normalised per head (q also scaled by d_k^-1/2), beta_t = sigmoid(b_t) and
g_t = -exp(A_log) softplus(a_t + dt_bias). The output is RMS-normed per head, times silu(z), and
projected back. A sequence's conv inputs (the last kernel-1) and its S live in a state slot of its
own (RecurrentState), so decode reads a fixed size per token however long the sequence.

Prefill runs the rule in chunks of 64 tokens (the UT transform): within a chunk, with gamma the
running sum of g and D[i, j] = exp(gamma_i - gamma_j),

    (I + A) Delta = beta V - beta exp(gamma) K S0,   A[i, j] = beta_i (k_i . k_j) D[i, j] for j < i
    O  = exp(gamma) Q S0 + ((Q K^T) * D, j <= i) Delta
    S1 = exp(gamma_last) S0 + (K exp(gamma_last - gamma))^T Delta

solved with one unit-lower-triangular solve per chunk; decode runs the one-token rule for the whole
batch at once. Plain torch (fp32 state and arithmetic); tested against the one-token rule and
against transformers' models (tests/models/test_hybrid_linear.py)."""
import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed.parallel import get_tp_rank, get_tp_size
from nanovllm.kernels.cpu_structs import DeltaNetLayer, Linear
from nanovllm.layers.c_description import CDescriber, CPart, NotInC, describes
from nanovllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from nanovllm.layers.sequence_state import SequenceStateLayer, causal_conv, causal_conv_step
from nanovllm.utils.context import get_context

CHUNK = 64


def l2_normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> torch.Tensor:
    """One token of each row: state [B, H, dk, dv] updated in place; q, k [B, H, dk] (normalised,
    q scaled), v [B, H, dv], g, beta [B, H]. Returns o [B, H, dv]."""
    state.mul_(g.exp()[..., None, None])
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    state.add_(k.unsqueeze(-1) * (beta.unsqueeze(-1) * (v - predicted)).unsqueeze(-2))
    return torch.einsum("bhkv,bhk->bhv", state, q)


def delta_rule_chunked(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The tokens of one sequence in chunks: state [H, dk, dv] (updated in place), q, k [H, L, dk],
    v [H, L, dv], g, beta [H, L]. Returns o [H, L, dv]."""
    heads, length, dk = k.shape
    pad = (-length) % chunk
    if pad:  # padded tokens: zero k and v, g 0, beta 0: they change nothing
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (length + pad) // chunk
    q, k, v = (x.reshape(heads, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(heads, n, chunk), beta.reshape(heads, n, chunk)
    gamma = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()  # D, j <= i
    kk = k @ k.transpose(-1, -2)
    system = torch.eye(chunk, device=q.device) + (beta.unsqueeze(-1) * kk * decay).tril(-1)
    rhs_v = beta.unsqueeze(-1) * v
    rhs_k = (beta * gamma.exp()).unsqueeze(-1) * k
    solved = torch.linalg.solve_triangular(system, torch.cat((rhs_v, rhs_k), -1), upper=False, unitriangular=True)
    u, w = solved.split([v.shape[-1], dk], dim=-1)  # Delta = u - w S0
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gamma.exp().unsqueeze(-1)
    k_to_end = k * (gamma[..., -1:] - gamma).exp().unsqueeze(-1)
    out = torch.empty_like(v)
    for c in range(n):
        delta = u[:, c] - w[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + scores[:, c] @ delta
        state.mul_(gamma[:, c, -1].exp()[:, None, None]).add_(k_to_end[:, c].transpose(-1, -2) @ delta)
    return out.reshape(heads, n * chunk, -1)[:, :length]


class RecurrentState:
    """One linear-attention layer's state slots: conv [slots, channels, kernel - 1] (the last
    inputs of the convolution) and delta [slots, value heads, dk, dv], fp32."""

    def __init__(self, slots: int, channels: int, kernel: int, heads: int, dk: int, dv: int, device):
        self.conv = torch.zeros(slots, channels, kernel - 1, device=device)
        self.delta = torch.zeros(slots, heads, dk, dv, device=device)

    @staticmethod
    def slot_bytes(channels: int, kernel: int, heads: int, dk: int, dv: int) -> int:
        return 4 * (channels * (kernel - 1) + heads * dk * dv)


class GatedRMSNorm(nn.Module):
    """RMS-norm over each head's values, times weight, times silu(gate) (in fp32)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(SequenceStateLayer):
    """A linear-attention layer. Checkpoint names (Qwen3.5): in_proj_qkv (cut into its q, k and v
    rows by the model's loader), in_proj_z, in_proj_b, in_proj_a: one stacked in_proj here, shards
    0-5; conv1d.weight [channels, 1, kernel], A_log, dt_bias [value heads], norm.weight [dv],
    out_proj. Tensor parallelism splits the heads: each rank its key heads' q and k, its value
    heads' v, z, b, a, the matching conv channels and A_log / dt_bias, and out_proj's inputs."""

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        tp = get_tp_size()
        total_k, total_v = config.linear_num_key_heads, config.linear_num_value_heads
        if total_v % total_k:
            raise ValueError(f"linear_num_value_heads ({total_v}) must be a multiple of "
                             f"linear_num_key_heads ({total_k})")
        if total_k % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide linear_num_key_heads ({total_k})")
        # The value heads' order: "grouped" (HF: each key head's value heads together) or "tiled"
        # (llama.cpp's files: value head h uses key head h mod key heads), loader/gguf_hybrid.py.
        self.tiled = getattr(config, "linear_value_head_order", "grouped") == "tiled" and total_v != total_k
        if self.tiled and tp > 1:
            raise ValueError("a GGUF file's linear layers (value heads tiled over the key heads) do not split "
                             f"over tensor_parallel_size={tp}; use 1")
        self.num_k_heads, self.num_v_heads = total_k // tp, total_v // tp
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.kernel = config.linear_conv_kernel_dim
        if not 2 <= self.kernel <= 8:
            raise ValueError(f"linear_conv_kernel_dim is {self.kernel}; the causal convolution takes 2..8")
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"the linear attention's convolution activation is {act!r}; supported: silu")
        self.key_dim, self.value_dim = self.num_k_heads * self.dk, self.num_v_heads * self.dv  # this rank's
        self.channels = 2 * self.key_dim + self.value_dim
        key_total, value_total = total_k * self.dk, total_v * self.dv
        self.in_proj = MergedColumnParallelLinear(
            config.hidden_size, [key_total, key_total, value_total, value_total, total_v, total_v], bias=False,
            quant_config=quant_config, prefix=f"{prefix}.in_proj")
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.channels, 1, self.kernel), requires_grad=False)
        self.conv1d.weight.weight_loader = self._load_conv
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        for param in (self.A_log, self.dt_bias):
            param.weight_loader = self._load_per_value_head
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(value_total, config.hidden_size, bias=False, quant_config=quant_config,
                                          prefix=f"{prefix}.out_proj")
        self.state: RecurrentState | None = None  # set by attach_state (ModelRunner.allocate_state_cache)
        self.c_kernels = None  # the CPU's C kernels, where the platform has them (kernels/cpu_deltanet.c)
        self.c_desc = None  # this layer as they read it (cpu_kernels.DeltaNetLayer), with c_kernels
        self.c_conv: torch.Tensor | None = None  # the conv weight as c_desc points into it
        self.use_triton = False  # the decode step in Triton, where the platform offers it (a GPU)

    def _rank_rows(self, loaded: torch.Tensor, sizes: list[int], what: str) -> torch.Tensor:
        """This rank's rows of a tensor stacked from parts of the given whole sizes, each split evenly."""
        if loaded.shape[0] != sum(sizes):
            raise ValueError(f"{what} has {loaded.shape[0]} rows, {sum(sizes)} expected")
        tp, rank = get_tp_size(), get_tp_rank()
        return torch.cat([part.chunk(tp)[rank] for part in loaded.split(sizes)])

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        tp = get_tp_size()
        rows = self._rank_rows(loaded, [self.key_dim * tp, self.key_dim * tp, self.value_dim * tp], "conv1d.weight")
        if tuple(rows.shape) != tuple(param.shape):
            raise ValueError(f"conv1d.weight has shape {tuple(loaded.shape)}; a kernel of {self.kernel} expected")
        param.data.copy_(rows)

    def _load_per_value_head(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(self._rank_rows(loaded, [self.num_v_heads * get_tp_size()], "A_log / dt_bias"))

    def new_state(self, slots: int, device) -> RecurrentState:
        return RecurrentState(slots, self.channels, self.kernel, self.num_v_heads, self.dk, self.dv, device)

    def attach_state(self, state: RecurrentState, c_kernels=None, use_triton: bool = False) -> None:
        """The state slots this layer's steps read, and the decode step's kernel: the CPU's C kernels
        (c_kernels: the state, conv weight, A_log, dt_bias and norm described once for them, and for
        the C one-call step, executor/cpu_decode.py), Triton (use_triton), else torch."""
        self.state, self.c_kernels, self.use_triton, self.c_desc = state, c_kernels, use_triton, None
        if c_kernels is None:
            return
        self.c_conv = self.conv_weight().contiguous()  # NOTE: c_desc points into it
        parts = (self.c_conv, state.conv, state.delta, self.A_log, self.dt_bias, self.norm.weight)
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in parts):
            raise ValueError("the C kernels read a linear-attention layer's state and parameters as dense fp32")
        self.c_desc = DeltaNetLayer(*(t.data_ptr() for t in parts), self.num_k_heads, self.num_v_heads, self.dk,
                                    self.dv, self.kernel, int(self.tiled))

    def slot_bytes(self) -> int:
        return RecurrentState.slot_bytes(self.channels, self.kernel, self.num_v_heads, self.dk, self.dv)

    def gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g, beta) of the in_proj's b and a rows: the state's log decay and the update's weight."""
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float()), b.float().sigmoid()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        proj = self.in_proj(hidden_states)
        batch = get_context().state
        if batch is not None and not get_context().is_prefill and self.c_desc is not None:
            return self.out_proj(self.run_decode_c(proj, batch.slots).to(hidden_states.dtype))
        mixed, z, b, a = proj.split([self.channels, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1)
        g, beta = self.gates(b, a)
        if batch is None:  # outside the engine's steps: the rows are one sequence
            out = self.run_sequence(mixed, g, beta, None, None)
        elif not get_context().is_prefill:
            out = self.run_decode(mixed, g, beta, batch.slots)
        else:
            outs, start = [], 0
            slots = batch.slots.tolist() if batch.slots is not None else [None] * len(batch.query_lens)
            for slot, n, fresh in zip(slots, batch.query_lens, batch.fresh):
                rows = slice(start, start + n)
                outs.append(self.run_sequence(mixed[rows], g[rows], beta[rows], slot, fresh))
                start += n
            out = torch.cat(outs)
        # out [tokens, value heads, dv]
        normed = self.norm(out.to(hidden_states.dtype), z.reshape(out.shape))
        return self.out_proj(normed.flatten(1))

    def conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight.squeeze(1).float()  # [channels, kernel]

    def split_heads(self, mixed: torch.Tensor):
        """q, k [..., value heads, dk] (each key head serving its run of value heads; normalised,
        q scaled) and v [..., value heads, dv] from the convolved channels."""
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        repeat = self.num_v_heads // self.num_k_heads
        q = l2_normalized(q.unflatten(-1, (self.num_k_heads, self.dk))) * self.dk ** -0.5
        k = l2_normalized(k.unflatten(-1, (self.num_k_heads, self.dk)))
        if repeat > 1 and self.tiled:
            tile = [1] * (q.dim() - 2) + [repeat, 1]
            q, k = q.repeat(*tile), k.repeat(*tile)
        elif repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2)
        return q, k, v.unflatten(-1, (self.num_v_heads, self.dv))

    def run_sequence(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slot: int | None,
                     fresh: bool | None) -> torch.Tensor:
        """One sequence's new tokens mixed [n, channels]: from its slot's state (zero when fresh or
        without a slot), which it leaves updated."""
        x = mixed.float().t()  # [channels, n]
        state = self.state
        if slot is None or fresh:
            history = x.new_zeros(self.channels, self.kernel - 1)
            delta = x.new_zeros(self.num_v_heads, self.dk, self.dv)
        else:
            history, delta = state.conv[slot], state.delta[slot].clone()
        conv, history = causal_conv(history, x, self.conv_weight())
        conv = F.silu(conv)
        q, k, v = self.split_heads(conv.t())  # [n, heads, d]
        out = delta_rule_chunked(delta, q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.t(), beta.t())
        if slot is not None:
            state.conv[slot] = history
            state.delta[slot] = delta
        return out.transpose(0, 1)  # [n, heads, dv]

    def run_decode(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token of each sequence, mixed [B, channels], all at once (the rule in Triton where the
        platform offers it, else torch; the reference of run_decode_c)."""
        conv, history = causal_conv_step(self.state.conv.index_select(0, slots), mixed.float(), self.conv_weight())
        conv = F.silu(conv)
        self.state.conv.index_copy_(0, slots, history)
        q, k, v = self.split_heads(conv)
        if self.use_triton:
            from nanovllm.kernels.triton_deltanet import deltanet_decode_step
            return deltanet_decode_step(self.state.delta, slots, q, k, v, g, beta)
        delta = self.state.delta.index_select(0, slots)
        out = delta_rule_step(delta, q, k, v, g, beta)
        self.state.delta.index_copy_(0, slots, delta)
        return out

    def run_decode_c(self, proj: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token of each sequence from its in_proj row proj [B, channels | z | b | a] through the
        C kernels: the gated-normed outputs [B, value heads * dv] (fp32), the states updated."""
        proj = proj.float().contiguous()
        slots = slots.to(torch.int64).contiguous()
        rows = proj.shape[0]
        out = torch.empty(rows, self.value_dim)
        scratch = torch.empty(rows, self.channels)
        self.c_kernels.deltanet_decode(ctypes.byref(self.c_desc), proj.data_ptr(), proj.shape[1], rows,
                                       slots.data_ptr(), self.norm.eps, out.data_ptr(), scratch.data_ptr(),
                                       torch.get_num_threads())
        return out


@describes(GatedDeltaNet)
def _c_gated_deltanet(lin: GatedDeltaNet, c: CDescriber) -> CPart:
    """Its state, conv weight and gates as attach_state described them, its in_proj and out_proj in
    the places of an attention layer's qkv and o; the one C call only (no phases of its own)."""
    if lin.c_desc is None:
        raise NotInC("it has no C description (no state slots for the C kernels)")
    c.eps.add(lin.norm.eps)
    qkv, o = c.linear(lin.in_proj, "its in_proj"), c.linear(lin.out_proj, "its out_proj")
    return CPart({"qkv": qkv or Linear(), "o": o or Linear(), "linear": ctypes.pointer(lin.c_desc)},
                 in_c=qkv is not None and o is not None, one_call_only=True)
