"""Mamba-2 layers (Granite 4.0-H; the SSD form of the selective state space): in_proj gives per
token a gate z, the inputs x, B and C (groups of N-wide vectors each shared by a run of heads) and
a time step dt per head; x, B and C pass a causal depthwise convolution (with bias, SiLU); then each
head h keeps a P x N state S that every token decays and adds to:

    dt = clamp(softplus(dt + dt_bias), limit)      a = dt * A,  A = -exp(A_log)
    S <- exp(a) S + dt x B^T        y = S C + D x

and the output is RMS-normed per group after the gate (norm(y * silu(z)) * w; Falcon-H1: before it,
or no norm), then out_proj.

Prefill runs the recurrence in chunks (SSD): within a chunk, with c the running sum of a,

    Y = ((C B^T) * exp(c_i - c_j), j <= i) (dt x) + exp(c) C S0
    S1 = exp(c_last) S0 + (dt x * exp(c_last - c))^T B

and decode runs the one-token rule for the batch at once. A sequence's conv inputs (the last
kernel - 1) and its S live in a state slot of its own (layers/sequence_state.py). Plain torch, fp32
state and arithmetic; the decode step is one C call on a CPU (kernels/cpu_deltanet.c mamba2_decode),
its state update a Triton kernel on a GPU (kernels/triton_deltanet.py mamba2_decode_step).

Tensor parallelism splits the heads: each rank its heads' z, x, dt, A_log, D, dt_bias, their conv
channels and norm weights, and out_proj's inputs. B and C split with the groups where the ranks
divide them; otherwise (one group, as Granite 4.0-H has) every rank computes them whole, and the
norm's sum of squares over a group spanning the ranks is summed across them."""
import ctypes

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed.parallel import get_tp_rank, get_tp_size
from nanovllm.kernels.cpu_structs import Linear, Mamba2Layer
from nanovllm.layers.c_description import CDescriber, CPart, NotInC, describes
from nanovllm.layers.linear import LinearBase, MergedColumnParallelLinear, RowParallelLinear, StackedColumnParallelLinear
from nanovllm.layers.sequence_state import SequenceStateLayer, causal_conv, causal_conv_step
from nanovllm.utils.context import get_context

CHUNK = 64


def ssd_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor) -> torch.Tensor:
    """One token of each row: state [R, H, P, N] updated in place; x [R, H, P], dt [R, H] (after
    softplus), A [H], B, C [R, H, N] (each head's group). Returns y [R, H, P] (without D x)."""
    state.mul_((dt * A).exp()[..., None, None]).add_((dt[..., None] * x)[..., None] * B[:, :, None, :])
    return (state @ C[..., None]).squeeze(-1)


def ssd_chunked(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The tokens of one sequence in chunks: state [H, P, N] (updated in place), x [L, H, P], dt
    [L, H], A [H], B, C [L, H, N]. Returns y [L, H, P] (without D x)."""
    length, heads, p = x.shape
    pad = (-length) % chunk
    if pad:  # padded tokens: dt 0 (no decay, nothing added)
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    n = (length + pad) // chunk
    x, B, C = (t.reshape(n, chunk, heads, t.shape[-1]).transpose(1, 2) for t in (x, B, C))  # [n, H, T, .]
    dt = dt.reshape(n, chunk, heads).transpose(1, 2)  # [n, H, T]
    cum = (dt * A[:, None]).cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    xdt = x * dt[..., None]
    y = ((C @ B.transpose(-1, -2)) * decay) @ xdt  # [n, H, T, P]
    added = (xdt * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2) @ B  # [n, H, P, N]
    for c in range(n):
        y[c] += (C[c] @ state.transpose(-1, -2)) * cum[c].exp()[..., None]
        state.mul_(cum[c, :, -1].exp()[:, None, None]).add_(added[c])
    return y.transpose(1, 2).reshape(n * chunk, heads, p)[:length]


def mamba2_inner(config) -> int:
    """The mixer's inner size: mamba_d_ssm (Falcon-H1), else mamba_expand x hidden_size."""
    return int(getattr(config, "mamba_d_ssm", None) or config.mamba_expand * config.hidden_size)


def in_proj_parts(name: str, tensor: torch.Tensor, inner: int, bc: int):
    """A checkpoint's whole Mamba-2 in_proj (weight or bias; rows z, x, B, C, dt) as the parts the
    mixer loads apart: (name of in_proj_z / _x / _B / _C / _dt, rows) pairs."""
    base, kind = name.rsplit(".in_proj.", 1)
    parts = tensor.split([inner, inner, bc, bc, tensor.shape[0] - 2 * inner - 2 * bc])
    return [(f"{base}.in_proj_{part}.{kind}", rows) for part, rows in zip(("z", "x", "B", "C", "dt"), parts)]


def is_in_proj(name: str) -> bool:
    return name.endswith(".mamba.in_proj.weight") or name.endswith(".mamba.in_proj.bias")


class Mamba2State:
    """One Mamba-2 layer's slots: conv [slots, channels, kernel - 1] and ssm [slots, heads, P, N], fp32."""

    def __init__(self, slots: int, channels: int, kernel: int, heads: int, p: int, n: int, device):
        self.conv = torch.zeros(slots, channels, kernel - 1, device=device)
        self.ssm = torch.zeros(slots, heads, p, n, device=device)


class ReplicatedStackedLinear(StackedColumnParallelLinear):
    """Several projections stored as one, whole on every rank (B and C where the ranks do not divide
    the groups)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, quant_config=None,
                 prefix: str = ""):
        self.output_sizes = output_sizes
        LinearBase.__init__(self, input_size, sum(output_sizes), bias, None, quant_config, prefix, list(output_sizes))

    def shard_index(self, shard_id: int) -> int:
        return shard_id


class Mamba2Mixer(SequenceStateLayer):
    """Checkpoint names (after the model's loader cuts in_proj into its parts): in_proj_z, in_proj_x,
    in_proj_dt (in_proj here, shards 0-2), in_proj_B, in_proj_C (bc_proj, shards 0-1), conv1d.weight
    [I + 2 G N, 1, K] and conv1d.bias, A_log, D, dt_bias [heads], norm.weight [I] (where
    mamba_rms_norm), out_proj."""

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        hidden = config.hidden_size
        heads, self.groups = int(config.mamba_n_heads), int(config.mamba_n_groups)
        self.p, self.n, self.kernel = int(config.mamba_d_head), int(config.mamba_d_state), int(config.mamba_d_conv)
        inner = mamba2_inner(config)
        if heads * self.p != inner:
            raise ValueError(f"mamba_n_heads x mamba_d_head ({heads} x {self.p}) must equal the inner size ({inner}: "
                             "mamba_d_ssm, else mamba_expand x hidden_size)")
        if heads % self.groups:
            raise ValueError(f"mamba_n_groups ({self.groups}) must divide mamba_n_heads ({heads})")
        if heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide mamba_n_heads ({heads})")
        if not 2 <= self.kernel <= 8:
            raise ValueError(f"mamba_d_conv is {self.kernel}; the causal convolution takes 2..8")
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"the Mamba-2 convolution's activation is {act!r}; supported: silu")
        self.heads, self.inner = heads // tp, inner // tp  # this rank's
        self.heads_per_group = heads // self.groups
        self.split_groups = self.groups % tp == 0
        self.bc_groups = self.groups // tp if self.split_groups else self.groups
        self.first_head = rank * self.heads  # the global index of this rank's first head
        self.channels = self.inner + 2 * self.bc_groups * self.n
        self.chunk = CHUNK
        limit = getattr(config, "time_step_limit", None) or (0.0, float("inf"))
        self.dt_min, self.dt_max = float(limit[0]), float(limit[1])
        bias = bool(getattr(config, "mamba_proj_bias", False))
        self.in_proj = MergedColumnParallelLinear(hidden, [inner, inner, heads], bias=bias, quant_config=quant_config,
                                                  prefix=f"{prefix}.in_proj")
        bc = self.groups * self.n
        self.bc_proj = (MergedColumnParallelLinear if self.split_groups else ReplicatedStackedLinear)(
            hidden, [bc, bc], bias=bias, quant_config=quant_config, prefix=f"{prefix}.bc_proj")
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.channels, 1, self.kernel), requires_grad=False)
        self.conv1d.bias = None
        if getattr(config, "mamba_conv_bias", True):
            self.conv1d.bias = nn.Parameter(torch.empty(self.channels), requires_grad=False)
            self.conv1d.bias.weight_loader = self._load_conv
        self.conv1d.weight.weight_loader = self._load_conv
        for name in ("A_log", "D", "dt_bias"):
            setattr(self, name, nn.Parameter(torch.empty(self.heads), requires_grad=False))
            getattr(self, name).weight_loader = self._load_per_head
        # the output: norm(y silu(z)) (Granite), norm(y) silu(z) (mamba_norm_before_gate), or y silu(z)
        # without a norm (Falcon-H1's mamba_rms_norm false)
        self.has_norm = bool(getattr(config, "mamba_rms_norm", True))
        self.norm_before_gate = self.has_norm and bool(getattr(config, "mamba_norm_before_gate", False))
        self.norm = None
        if self.has_norm:
            self.norm = nn.Module()
            self.norm.weight = nn.Parameter(torch.empty(self.inner), requires_grad=False)
            self.norm.weight.weight_loader = self._load_per_head
        self.eps = float(config.rms_norm_eps)
        self.out_proj = RowParallelLinear(inner, hidden, bias=bool(getattr(config, "projectors_bias", bias)),
                                          quant_config=quant_config, prefix=f"{prefix}.out_proj")
        self.state: Mamba2State | None = None
        self.c_kernels = None
        self.c_desc: Mamba2Layer | None = None
        self.c_parts: tuple | None = None  # the tensors c_desc points into
        self.use_triton = False  # the decode step's state update in Triton, where the platform offers it (a GPU)

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's channels of the conv: its heads' x, and B and C (its groups', or whole)."""
        tp, rank = get_tp_size(), get_tp_rank()
        bc = self.groups * self.n
        if loaded.shape[0] != self.inner * tp + 2 * bc:
            raise ValueError(f"conv1d has {loaded.shape[0]} channels, {self.inner * tp + 2 * bc} expected")
        x, b, c = loaded.split([self.inner * tp, bc, bc])
        parts = [x.chunk(tp)[rank]] + ([b.chunk(tp)[rank], c.chunk(tp)[rank]] if self.split_groups else [b, c])
        param.data.copy_(torch.cat(parts).reshape(param.shape))

    def _load_per_head(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        tp = get_tp_size()
        if loaded.numel() != param.numel() * tp:
            raise ValueError(f"a per-head Mamba-2 tensor of {loaded.numel()} values, {param.numel() * tp} expected")
        param.data.copy_(loaded.reshape(-1).chunk(tp)[get_tp_rank()])

    def slot_bytes(self) -> int:
        return 4 * (self.channels * (self.kernel - 1) + self.heads * self.p * self.n)

    def new_state(self, slots: int, device) -> Mamba2State:
        return Mamba2State(slots, self.channels, self.kernel, self.heads, self.p, self.n, device)

    def attach_state(self, state: Mamba2State, c_kernels=None, use_triton: bool = False) -> None:
        """The slots this layer's steps read; with c_kernels (the CPU's), the decode step's C call
        (mamba2_decode) and its description of the layer."""
        self.state, self.c_kernels, self.c_desc, self.use_triton = state, c_kernels, None, use_triton
        if c_kernels is None or get_tp_size() > 1 and not self.split_groups:
            return  # (a group spanning the ranks: its norm sums across them, in torch)
        conv_bias = self.conv1d.bias if self.conv1d.bias is not None else torch.zeros(self.channels)
        norm = self.norm.weight.float() if self.has_norm else None
        self.c_parts = (self.taps().contiguous(), conv_bias.float().contiguous(), state.conv, state.ssm,
                        self.A_log.float(), self.D.float(), self.dt_bias.float(), norm)
        # (its matrices, proj and out, are filled in by its C describer for the one-call step)
        self.c_desc = Mamba2Layer(Linear(), Linear(), *(0 if t is None else t.data_ptr() for t in self.c_parts),
                                  self.heads, self.p, self.n, self.bc_groups, self.heads_per_group, self.kernel,
                                  self.inner // self.norm_groups(), int(self.norm_before_gate), self.dt_min,
                                  self.dt_max)

    def taps(self) -> torch.Tensor:
        return self.conv1d.weight.squeeze(1).float()  # [channels, kernel]

    def conv_bias(self) -> torch.Tensor | None:
        return None if self.conv1d.bias is None else self.conv1d.bias.float()

    def norm_groups(self) -> int:
        """The norm's groups on this rank (its share of them, or 1 of a group spanning the ranks)."""
        return self.bc_groups if self.split_groups else 1

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        proj = self.in_proj(hidden_states).float()
        bc = self.bc_proj(hidden_states).float()
        batch = get_context().state
        if batch is not None and not get_context().is_prefill and self.c_desc is not None:
            y = self.run_decode_c(torch.cat((proj, bc), dim=-1), batch.slots)
            return self.out_proj(y.to(hidden_states.dtype))
        z, x, dt = proj.split([self.inner, self.inner, self.heads], dim=-1)
        mixed = torch.cat((x, bc), dim=-1)
        if batch is None:  # outside the engine's steps: the rows are one sequence
            y = self.run_sequence(mixed, dt, None, None)
        elif not get_context().is_prefill:
            y = self.run_decode(mixed, dt, batch.slots)
        else:
            outs, start = [], 0
            slots = batch.slots.tolist() if batch.slots is not None else [None] * len(batch.query_lens)
            for slot, n, fresh in zip(slots, batch.query_lens, batch.fresh):
                outs.append(self.run_sequence(mixed[start:start + n], dt[start:start + n], slot, fresh))
                start += n
            y = torch.cat(outs)
        return self.out_proj(self.gated_norm(y.flatten(1), z).to(hidden_states.dtype))

    def time_steps(self, dt: torch.Tensor) -> torch.Tensor:
        return F.softplus(dt + self.dt_bias.float()).clamp(self.dt_min, self.dt_max)

    def split(self, conv: torch.Tensor):
        """x [..., heads, P] and each head's B and C [..., heads, N] from the convolved channels."""
        x, b, c = conv.split([self.inner, self.bc_groups * self.n, self.bc_groups * self.n], dim=-1)
        # this rank's head i reads group (its global index) // heads_per_group, counted among the
        # groups this rank holds
        first = self.first_head if not self.split_groups else self.first_head % (self.heads_per_group * self.bc_groups)
        index = (torch.arange(self.heads, device=conv.device) + first) // self.heads_per_group
        b, c = (t.unflatten(-1, (self.bc_groups, self.n)).index_select(-2, index) for t in (b, c))
        return x.unflatten(-1, (self.heads, self.p)), b, c

    def run_sequence(self, mixed: torch.Tensor, dt: torch.Tensor, slot: int | None, fresh: bool | None) -> torch.Tensor:
        """One sequence's new tokens: from its slot's state (zero when fresh or without a slot),
        which it leaves updated. Returns y [n, heads, P] (with D x)."""
        state = self.state
        if slot is None or fresh:
            history = mixed.new_zeros(self.channels, self.kernel - 1)
            ssm = mixed.new_zeros(self.heads, self.p, self.n)
        else:
            history, ssm = state.conv[slot], state.ssm[slot].clone()
        conv, history = causal_conv(history, mixed.t(), self.taps(), self.conv_bias())
        x, b, c = self.split(F.silu(conv.t()))
        y = ssd_chunked(ssm, x, self.time_steps(dt), -self.A_log.float().exp(), b, c, self.chunk)
        if slot is not None:
            state.conv[slot] = history
            state.ssm[slot] = ssm
        return y + self.D.float()[:, None] * x

    def run_decode(self, mixed: torch.Tensor, dt: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token of each sequence at once (the reference of run_decode_c). Returns y [B, heads, P]."""
        conv, history = causal_conv_step(self.state.conv.index_select(0, slots), mixed, self.taps(), self.conv_bias())
        self.state.conv.index_copy_(0, slots, history)
        x, b, c = self.split(F.silu(conv))
        A = -self.A_log.float().exp()
        if self.use_triton:
            from nanovllm.kernels.triton_deltanet import mamba2_decode_step
            return mamba2_decode_step(self.state.ssm, slots, x, self.time_steps(dt), A, b, c, self.D)
        ssm = self.state.ssm.index_select(0, slots)
        y = ssd_step(ssm, x, self.time_steps(dt), A, b, c)
        self.state.ssm.index_copy_(0, slots, ssm)
        return y + self.D.float()[:, None] * x

    def gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The output (fp32): RMS-norm over each group's channels of y * silu(z), times the weight; or
        the norm of y, times the weight and silu(z) (norm_before_gate); or y * silu(z) (no norm)."""
        if not self.has_norm:
            return y * F.silu(z)
        g = (y if self.norm_before_gate else y * F.silu(z)).unflatten(-1, (self.norm_groups(), -1))
        sq = g.pow(2).sum(-1, keepdim=True)
        width = g.shape[-1]
        if get_tp_size() > 1 and not self.split_groups:  # the one group spans the ranks
            dist.all_reduce(sq)
            width *= get_tp_size()
        out = (g * torch.rsqrt(sq / width + self.eps)).flatten(-2) * self.norm.weight.float()
        return out * F.silu(z) if self.norm_before_gate else out

    def run_decode_c(self, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token of each sequence from its rows [B, z | x | dt | B C] through the C kernel: the
        gated-normed outputs [B, inner] (fp32), the states updated."""
        rows = rows.contiguous()
        slots = slots.to(torch.int64).contiguous()
        out = torch.empty(rows.shape[0], self.inner)
        scratch = torch.empty(rows.shape[0], self.channels)
        self.c_kernels.mamba2_decode(ctypes.byref(self.c_desc), rows.data_ptr(), rows.shape[1], rows.shape[0],
                                     slots.data_ptr(), ctypes.c_float(self.eps), out.data_ptr(), scratch.data_ptr(),
                                     torch.get_num_threads())
        return out


@describes(Mamba2Mixer)
def _c_mamba2(mixer: Mamba2Mixer, c: CDescriber) -> CPart:
    """Its state, conv and SSM parameters as attach_state described them, with its matrices: in_proj
    with bc_proj chained after it (one matrix of rows [z | x | dt | B | C]) and out_proj; the one C
    call only (no phases of its own). The layer's qkv and o stay its attention's, where it has one
    beside the mixer (Falcon-H1)."""
    if mixer.c_desc is None:
        raise NotInC("it has no C description (no state slots for the C kernels, or a group spanning the ranks)")
    c.eps.add(mixer.eps)
    proj, bc = c.linear(mixer.in_proj, "its in_proj"), c.linear(mixer.bc_proj, "its bc_proj")
    out = c.linear(mixer.out_proj, "its out_proj")
    in_c = proj is not None and bc is not None and out is not None
    if in_c:
        last = proj
        while last.next:
            last = Linear.from_address(last.next)
        last.next = ctypes.addressof(bc)  # (c keeps bc alive)
        mixer.c_desc.proj, mixer.c_desc.out = proj, out  # copies: their chains stay the originals'
    return CPart({"mamba2": ctypes.pointer(mixer.c_desc)}, in_c=in_c, one_call_only=True)
