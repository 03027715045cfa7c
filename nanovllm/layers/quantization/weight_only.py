"""The weights of pre-quantized checkpoints (compressed-tensors, GPTQ, AWQ, FP8: one module each),
read into one form and held as the C kernels' block rows without rounding anything.

A format's method names the checkpoint tensors a layer loads (`tensors`) and decodes them after
loading into a QuantizedWeight:
    integer: w[o, i] = scales[o, g(i)] * (values[o, i] - zeros[o, g(i)]),   g(i) = g_idx[i] or i // group
    fp8:     w[o, i] = float(values[o, i]) * scales[o, i // group]
which `to_blocks` repacks into the smallest block format that holds it exactly, 32 inputs per block
sharing one scale (a group of 128 is four blocks with its scale repeated):
    values - zeros in [-8, 7]     -> Q4_0 (4-bit, symmetric)
    values - zeros in [-16, 15]   -> Q5_0 (4-bit with zero points: the zero point moves into the value)
    values - zeros in [-128, 127] -> Q8_0 (8-bit, symmetric)
    fp8                           -> e4m3 blocks (kernels/cpu_quant.c: an fp32 scale, 32 fp8 bytes)
The Q blocks carry fp16 scales, so every scale must be exactly an fp16 (bf16 and fp16 scales of
real weights are). Where no block format is exact (8-bit zero points that move values out of int8,
scales that are no fp16, groups that are not whole blocks of 32) the layer is dequantized once into
dense fp32, exact too (an fp16 scale times a 9-bit integer needs 20 of fp32's 24 bits), and the
log says so. Inputs grouped out of order (GPTQ's desc_act, compressed-tensors' actorder) are
permuted at load so that each group's inputs are adjacent, and the layer's input is permuted the
same way before its kernel. Without the C kernels (a GPU) the weight is dequantized into the
model dtype."""
import logging
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.layers.quantization.base import CWeightView, LinearKernels, LinearMethodBase
from nanovllm.layers.quantization.gguf import GGUFLinearMethod
from nanovllm.layers.quantization.parameter import tagged_parameter
from nanovllm.layers.quantization.unquantized import UnquantizedLinearMethod

logger = logging.getLogger(__name__)

BLOCK = 32  # inputs per block of the block formats below


@dataclass
class QuantizedWeight:
    """One layer's weight (this rank's, its stacked parts one after another) as its format defines it."""

    values: torch.Tensor                # int32 [n, k], or float8_e4m3fn [n, k]
    scales: torch.Tensor                # fp32 [n, groups]
    group: int                          # inputs per group (k: one scale per output channel)
    zeros: torch.Tensor | None = None   # int32 [n, groups]
    g_idx: torch.Tensor | None = None   # int64 [k]: the group of each input (None: i // group)

    def group_ids(self) -> torch.Tensor:
        k = self.values.shape[1]
        return self.g_idx if self.g_idx is not None else torch.arange(k, device=self.values.device) // self.group

    def dequantize(self) -> torch.Tensor:
        """The weight as fp32 [n, k], by the definition above."""
        gid = self.group_ids()
        scales = self.scales.float()[:, gid]
        if self.values.dtype == torch.float8_e4m3fn:
            return self.values.float() * scales
        v = self.values if self.zeros is None else self.values - self.zeros[:, gid]
        return v.float() * scales


@dataclass(frozen=True)
class TensorSpec:
    """A checkpoint tensor of a quantized layer: its name after the layer's (e.g. "qweight"), its
    shape for this rank's stacked layer (None: a single number), the dtype it is held in and its
    parameter tags (parameter.py). per_part: loaded whole for each stacked part and kept per part (a per-tensor
    scale, g_idx, compressed-tensors' weight_shape)."""

    name: str
    shape: tuple[int, ...] | None
    dtype: torch.dtype
    output_dim: int | None = None
    input_dim: int | None = None
    packed_dim: int | None = None
    packed_factor: int = 1
    per_part: bool = False


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """int32 words holding 32 / bits unsigned values each (the lowest bits first, or value order[j]
    in the j-th lowest bits) along dim, as int32 values."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    words = packed.to(torch.int32).movedim(dim, -1)
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)   # [..., words, per]: the j-th lowest bits
    if order is not None:
        # value j sits in position order.index(j)
        values = values[..., torch.tensor(order, device=packed.device).argsort()]
    return values.reshape(*words.shape[:-1], -1).movedim(-1, dim)


def _fp16_exact(scales: torch.Tensor) -> bool:
    half = scales.to(torch.float16)
    return bool(torch.isfinite(half).all() and torch.equal(half.float(), scales.float()))


def _block_scales(qw: QuantizedWeight, gid: torch.Tensor) -> torch.Tensor | None:
    """fp32 [n, k / 32]: each block's scale, or None unless every block lies in one group."""
    k = gid.numel()
    if k % BLOCK:
        return None
    blocks = gid.reshape(-1, BLOCK)
    if not torch.equal(blocks, blocks[:, :1].expand_as(blocks)):
        return None
    return qw.scales.float()[:, blocks[:, 0]]


def _int_blocks(v: torch.Tensor, d: torch.Tensor, type_name: str) -> torch.Tensor:
    """Block rows of type_name (ggml's layouts: fp16 d, then the values) of values v [n, k] with
    block scales d [n, k / 32]."""
    n, k = v.shape
    nb = k // BLOCK
    v = v.reshape(n, nb, BLOCK)
    head = d.to(torch.float16).reshape(n, nb, 1).view(torch.uint8)   # [n, nb, 2]
    if type_name == "q8_0":
        body = v.to(torch.int8).view(torch.uint8)
    else:
        code = (v + (8 if type_name == "q4_0" else 16)).to(torch.int32)  # unsigned 4 / 5-bit codes
        qs = ((code[..., :16] & 0xF) | ((code[..., 16:] & 0xF) << 4)).to(torch.uint8)  # value j and j + 16
        if type_name == "q4_0":
            body = qs
        else:  # q5_0: the fifth bits of the 32 values as a little-endian uint32, before the nibbles
            qh = ((code >> 4) & 1) << torch.arange(BLOCK, dtype=torch.int32)
            qh = qh.to(torch.int64).sum(-1, keepdim=True).to(torch.int32).view(torch.uint8)  # [n, nb, 4]
            body = torch.cat([qh, qs], -1)
    return torch.cat([head, body], -1).reshape(n, -1).contiguous()


INT_FORMATS = (("q4_0", -8, 7), ("q5_0", -16, 15), ("q8_0", -128, 127))


def to_blocks(qw: QuantizedWeight) -> tuple[str, torch.Tensor, torch.Tensor | None] | None:
    """(C type, block rows uint8 [n, row bytes], the input permutation or None) holding qw exactly,
    or None where no block format does."""
    gid = qw.group_ids()
    perm = None
    if qw.g_idx is not None and not torch.equal(gid, torch.arange(gid.numel()) // qw.group):
        perm = torch.argsort(gid, stable=True)
        gid = gid[perm]
    d = _block_scales(qw, gid)
    if d is None:
        return None
    values = qw.values if perm is None else qw.values[:, perm]
    if values.dtype == torch.float8_e4m3fn:
        d = d * 256.0  # the kernel widens e4m3 into fp16 holding the value times 2^-8 (exact: a power of two)
        n, nb = d.shape
        body = values.contiguous().view(torch.uint8).reshape(n, nb, BLOCK)
        rows = torch.cat([d.reshape(n, nb, 1).view(torch.uint8), body], -1).reshape(n, -1).contiguous()
        return "e4m3", rows, perm
    if not _fp16_exact(d):
        return None
    v = values if qw.zeros is None else values - qw.zeros[:, gid]
    lo, hi = int(v.min()), int(v.max())
    for type_name, first, last in INT_FORMATS:
        if first <= lo and hi <= last:
            return type_name, _int_blocks(v, d, type_name), perm
    return None


class WeightOnlyLinearMethod(LinearMethodBase):
    """Base of the pre-quantized formats' linear methods: loads the checkpoint's tensors as the
    format lays them out (specs from `tensors`, sharded and stacked by their tags), decodes them
    (`decode`) after loading, and hands the layer to the method that multiplies the result:
    the block formats' (gguf.py, GGUFLinearMethod) or the dense one."""

    format_name = "?"
    may_tie = False  # its own tensors, beside the dense embedding table (LinearMethodBase.may_tie)
    input_planes = 2  # the block kernels' input rounding (CWeightView.input_planes), set by the config

    def __init__(self):
        self.inner = None
        self.perm = None

    # ---- what a format defines -------------------------------------------------------------------
    def tensors(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> list[TensorSpec]:
        raise NotImplementedError

    def decode(self, layer: nn.Module, loaded: dict[str, torch.Tensor],
               per_part: dict[str, list[torch.Tensor]]) -> QuantizedWeight:
        """This rank's weight from its loaded tensors (per_part: the per-part ones, in part order)."""
        raise NotImplementedError

    # ---- the layer's life ------------------------------------------------------------------------
    @property
    def name(self) -> str:
        inner = "not loaded" if self.inner is None else self.inner.name
        return f"{self.format_name} as {inner}{', inputs permuted' if self.perm is not None else ''}"

    @property
    def c_only(self) -> bool:
        return self.inner is not None and self.inner.c_only and self.perm is None

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        self.params_dtype = params_dtype
        self.sizes = list(output_partition_sizes)
        self.k = input_size
        self.specs = self.tensors(layer, input_size, self.sizes)
        self.layer_ref = layer
        for spec in self.specs:
            tags = dict(output_dim=spec.output_dim, input_dim=spec.input_dim, packed_dim=spec.packed_dim,
                        packed_factor=spec.packed_factor)
            if spec.per_part:
                param = tagged_parameter(torch.empty(0, dtype=spec.dtype), self.load_per_part, **tags)
                param.parts = {}
                param.spec = spec
                layer.register_parameter(spec.name, param)
            else:
                layer.register_weight(spec.name, torch.empty(spec.shape, dtype=spec.dtype), **tags)

    def load_per_part(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        layer = self.layer_ref
        index = 0 if shard_id is None else layer.shard_index(shard_id)
        part = layer.rank_part(param, loaded)
        if param.spec.shape is None:  # a per-tensor scale: one number, saved as [] or [1]
            if part.numel() != 1:
                raise ValueError(f"{layer.prefix}.{param.spec.name}: one value per tensor expected, got shape "
                                 f"{tuple(part.shape)}")
            part = part.reshape(1)
        elif tuple(part.shape) != param.spec.shape:
            raise ValueError(f"{layer.prefix}.{param.spec.name}: shape {tuple(part.shape)}, expected {param.spec.shape}")
        param.parts[index] = part.to(param.spec.dtype).clone()

    def process_weights_after_loading(self, layer: nn.Module, kernels: LinearKernels, is_shared: bool) -> None:
        loaded, per_part = {}, {}
        for spec in self.specs:
            param = getattr(layer, spec.name)
            if spec.per_part:
                expected = len(self.sizes) if hasattr(layer, "shard_index") else 1
                if sorted(param.parts) != list(range(expected)):
                    raise ValueError(f"{layer.prefix}: {spec.name} of parts {sorted(param.parts)} of {expected} loaded")
                per_part[spec.name] = [param.parts[i] for i in range(expected)]
            else:
                loaded[spec.name] = param.data
            delattr(layer, spec.name)
        qw = self.decode(layer, loaded, per_part)
        self.layer_ref = None
        self.inner = self._hold(layer, qw, kernels)
        self.inner.process_weights_after_loading(layer, kernels, is_shared)

    def _hold(self, layer: nn.Module, qw: QuantizedWeight, kernels: LinearKernels) -> LinearMethodBase:
        """Register layer.weight in the form a method multiplies from; that method."""
        if kernels.triton_weight_only:
            inner = triton_method(layer, qw, self.format_name)
            if inner is not None:
                return inner
        held = to_blocks(qw) if kernels.c_kernels is not None else None
        if held is not None:
            type_name, rows, self.perm = held
            return GGUFLinearMethod.holding(layer, type_name, rows, self.k, self.input_planes)
        dtype = torch.float32 if kernels.c_kernels is not None else self.params_dtype
        if kernels.c_kernels is not None:
            logger.info("%s: no block format holds its %s weights exactly; held dense (fp32)",
                        layer.prefix, self.format_name)
        elif not getattr(WeightOnlyLinearMethod, "said_dense", False):
            WeightOnlyLinearMethod.said_dense = True
            logger.warning("no kernels for %s weights here (a GPU, or no C kernels): dequantized once to %s",
                           self.format_name, str(dtype).removeprefix("torch."))
        layer.register_weight("weight", qw.dequantize().to(dtype), output_dim=0, input_dim=1)
        return UnquantizedLinearMethod()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return self.inner.apply(layer, x, bias)

    def c_view(self, layer: nn.Module) -> CWeightView | None:
        return None if self.perm is not None else self.inner.c_view(layer)

    def streamed_weights(self, layer: nn.Module) -> list[torch.Tensor]:
        return self.inner.streamed_weights(layer)


class TritonWeightOnlyMethod(LinearMethodBase):
    """x W^T by the Triton weight-only kernel (kernels/triton_weight_only.py) over its packed layout."""

    def __init__(self, packed, format_name: str):
        self.packed = packed
        kind = "fp8" if packed.fp8 else f"int{packed.bits}"
        self.name = f"{format_name} as {kind} (Triton kernel{', inputs by g_idx' if packed.g_idx is not None else ''})"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from nanovllm.kernels.triton_weight_only import weight_only_linear
        shape = x.shape
        y = weight_only_linear(x.reshape(-1, shape[-1]), self.packed, bias)
        return y.reshape(*shape[:-1], y.shape[-1])

    def streamed_weights(self, layer: nn.Module) -> list[torch.Tensor]:
        p = self.packed
        return [t for t in (p.q, p.scales, p.zeros, p.g_idx) if t is not None]


def triton_method(layer: nn.Module, qw: QuantizedWeight, format_name: str) -> LinearMethodBase | None:
    """The Triton kernel's method for qw, its packed weight registered as layer.weight (None where
    Triton is absent or the integers span more than 8 bits)."""
    try:
        from nanovllm.kernels.triton_weight_only import pack
    except ImportError:
        return None
    packed = pack(qw.values, qw.scales, qw.group, qw.zeros, qw.g_idx)
    if packed is None:
        return None
    layer.register_weight("weight", packed.q, output_dim=0, input_dim=1)
    return TritonWeightOnlyMethod(packed, format_name)


def shared_g_idx(layer: nn.Module, per_part: dict[str, list[torch.Tensor]], name: str, groups: int) -> torch.Tensor:
    """The group of each input, one for every stacked part (q / k / v read the same inputs), within [0, groups)."""
    parts = per_part[name]
    if any(not torch.equal(p, parts[0]) for p in parts[1:]):
        raise ValueError(f"{layer.prefix}: its stacked parts order their inputs differently ({name})")
    if int(parts[0].min()) < 0 or int(parts[0].max()) >= groups:
        raise ValueError(f"{layer.prefix}: {name} names groups outside [0, {groups})")
    return parts[0]


def check_group_split(layer: nn.Module, group: int | None) -> None:
    """ValueError unless this rank's inputs of a row-parallel layer are whole groups."""
    if group is None or getattr(layer, "tp_dim", None) != 1 or layer.tp_size == 1:
        return
    k = layer.input_size
    if k % group:
        raise ValueError(f"{layer.prefix}: tensor_parallel_size={layer.tp_size} splits its {k * layer.tp_size} inputs "
                         f"into parts of {k}, cutting its quantization groups of {group} inputs; use a "
                         f"tensor_parallel_size that divides {k * layer.tp_size // group} groups")
