"""compressed-tensors checkpoints (what llm-compressor writes; quant_method "compressed-tensors"),
weight-only: int4 / int8 in the `pack-quantized` format (or int8 `int-quantized`), symmetric or
with zero points, one scale per output channel or per group of inputs, and fp8 `float-quantized`
(per tensor, channel, group or block). The quantization_config's config_groups name each scheme's
targets ("Linear", module names, "re:" patterns), `ignore` the modules kept dense (lm_head).

The format, as compressed-tensors defines it (compressors/pack_quantized): weight_packed int32
[out, in * bits / 32] holds the values offset by 2^(bits - 1) (unsigned), element j at bits
j * bits of the row's bit string; weight_zero_point (with zero points) the same offset values
packed along the outputs, [out * bits / 32, groups]; weight_scale [out, groups]; weight_shape the
dense shape; w = scale * (value - zero_point). weight_g_idx (actorder "group" / "weight"): the group
of each input. fp8: weight float8_e4m3fn, w = weight * weight_scale.
Activations stay unquantized (W8A16 / W4A16); an fp8 scheme's dynamic or static activation
quantization runs weight-only, as vLLM runs fp8 checkpoints where the GPU has no fp8 (Marlin)."""
import logging
import re
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.layers.quantization.prequantized import PrequantizedConfig
from nanovllm.layers.quantization.weight_only import (QuantizedWeight, TensorSpec, WeightOnlyLinearMethod,
                                                      check_group_split, shared_g_idx, unpack_int32)

logger = logging.getLogger(__name__)

# The formats of each weight type (naive-quantized / int-quantized / float-quantized: the values as
# a tensor of their own dtype, int8 or float8_e4m3fn, named `weight`).
FORMATS = {("int", 4): ("pack-quantized",), ("int", 8): ("pack-quantized", "int-quantized", "naive-quantized"),
           ("float", 8): ("float-quantized", "naive-quantized")}
STRATEGIES = {"int": ("channel", "group"), "float": ("tensor", "channel", "group", "block")}


@dataclass(frozen=True)
class Scheme:
    type: str                   # "int" | "float"
    bits: int
    symmetric: bool
    strategy: str
    group_size: int | None      # group strategy: inputs per group
    block: tuple[int, int] | None  # block strategy: (outputs, inputs) per scale
    actorder: bool              # weight_g_idx gives each input's group
    format: str

    @classmethod
    def parse(cls, name: str, group: dict, default_format: str | None) -> "Scheme":
        w = group.get("weights")
        if not w:
            raise ValueError(f"compressed-tensors scheme {name!r} quantizes no weights")
        if group.get("input_activations") is not None or group.get("output_activations") is not None:
            if w.get("type") != "float":
                raise ValueError(f"compressed-tensors scheme {name!r}: activation quantization of an integer "
                                 "scheme (W8A8 / W4A8) is not supported; weight-only schemes (W8A16, W4A16) are")
            logger.info("compressed-tensors scheme %r: its fp8 activation quantization is not run; the fp8 weights "
                        "multiply unquantized activations (weight-only)", name)
        type_, bits, strategy = w.get("type", "int"), w.get("num_bits"), w.get("strategy")
        fmt = group.get("format") or default_format
        if type_ not in STRATEGIES:
            raise ValueError(f"compressed-tensors scheme {name!r}: weight type {type_!r} is not supported (int, float)")
        if (type_, bits) not in FORMATS:
            raise ValueError(f"compressed-tensors scheme {name!r}: {bits}-bit {type_} weights are not supported "
                             "(int 4 / 8, float 8)")
        if strategy not in STRATEGIES[type_]:
            raise ValueError(f"compressed-tensors scheme {name!r}: strategy {strategy!r} is not supported for {type_} "
                             f"weights ({', '.join(STRATEGIES[type_])})")
        if w.get("dynamic"):
            raise ValueError(f"compressed-tensors scheme {name!r}: dynamic weight quantization is not supported")
        expected = FORMATS[type_, bits]
        if fmt not in expected:
            raise ValueError(f"compressed-tensors scheme {name!r}: format {fmt!r} is not supported for {bits}-bit "
                             f"{type_} weights ({', '.join(expected)})")
        if type_ == "float" and not w.get("symmetric", True):
            raise ValueError(f"compressed-tensors scheme {name!r}: fp8 weights with zero points are not supported")
        group_size = w.get("group_size")
        if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0):
            raise ValueError(f"compressed-tensors scheme {name!r}: group strategy needs a positive group_size, "
                             f"got {group_size!r}")
        block = w.get("block_structure")
        if isinstance(block, str):  # older versions: "128x128"
            block = [int(b) for b in block.split("x")]
        if strategy == "block" and (not isinstance(block, (list, tuple)) or len(block) != 2):
            raise ValueError(f"compressed-tensors scheme {name!r}: block strategy needs a block_structure [out, in], "
                             f"got {block!r}")
        return cls(type_, bits, bool(w.get("symmetric", True)), strategy, group_size if strategy == "group" else None,
                   tuple(block) if strategy == "block" else None,
                   w.get("actorder") in ("group", "weight") and strategy == "group", fmt)


def _target_kind(target: str) -> str:
    return "re" if target.startswith("re:") else "Linear" if target == "Linear" else "name"


def _matches(module: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == "Linear" or module == target


class CompressedTensorsConfig(PrequantizedConfig):
    name = "compressed-tensors"
    key_tensors = ("weight_packed", "weight_scale")

    def __init__(self, groups: list[tuple[list[str], Scheme]], ignore: list[str], header: dict, mapping: dict):
        super().__init__(header, mapping)
        self.groups = groups
        self.ignore = ignore

    @classmethod
    def parse(cls, qc: dict, header: dict, packed_modules_mapping: dict) -> "CompressedTensorsConfig":
        for key in ("sparsity_config", "transform_config"):
            if qc.get(key):
                raise ValueError(f"compressed-tensors {key} is not supported (got {qc[key]!r})")
        status = qc.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"compressed-tensors quantization_status {status!r} is not supported; save the model "
                             "compressed (save_compressed=True)")
        groups = [(list(g.get("targets") or []), Scheme.parse(name, g, qc.get("format")))
                  for name, g in (qc.get("config_groups") or {}).items()]
        if not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        return cls(groups, list(qc.get("ignore") or []), header, packed_modules_mapping)

    def scheme_for(self, module: str) -> Scheme | None:
        if any(_matches(module, t) for t in self.ignore if t != "Linear"):
            return None
        # compressed-tensors' precedence over all groups' targets (utils/match.py, match_targets): the
        # module's exact name, then a "re:" pattern, then the class name "Linear"
        for kind in ("name", "re", "Linear"):
            for targets, scheme in self.groups:
                if any(_matches(module, t) and _target_kind(t) == kind for t in targets):
                    # a "Linear" target quantizes the linear layers the checkpoint has quantized tensors for
                    dense = self.header.get(f"{module}.weight", ("F8_E4M3",))[0] not in ("F8_E4M3", "I8")
                    return None if dense else scheme
        return None

    def method(self, scheme: Scheme, layer: nn.Module, modules: list[str]) -> WeightOnlyLinearMethod:
        return CompressedTensorsLinearMethod(scheme)

    def input_groups(self, module: str) -> int | None:
        scheme, scale = self.scheme_for(module), self.header.get(f"{module}.weight_scale")
        if scheme is None or scale is None or scheme.strategy not in ("group", "block") or scheme.actorder:
            return None
        return scale[1][1]

    def output_blocks(self, module: str) -> int | None:
        scheme, scale = self.scheme_for(module), self.header.get(f"{module}.weight_scale")
        return scale[1][0] if scheme is not None and scale is not None and scheme.strategy == "block" else None

    def check_checkpoint(self) -> None:
        modules = {n.rsplit(".", 1)[0] for n in self.header
                   if n.endswith((".weight_packed", ".weight_scale", ".weight_zero_point"))}
        for module in sorted(modules):
            scheme = self.scheme_for(module)
            if scheme is None:
                raise ValueError(f"{module}: the checkpoint holds quantized tensors for it, but no config_groups "
                                 "target matches it (or it is ignored)")
            names = ["weight_packed", "weight_scale", "weight_shape"] if scheme.format == "pack-quantized" \
                else ["weight", "weight_scale"]
            if scheme.type == "int" and not scheme.symmetric:
                names.append("weight_zero_point")
            if scheme.actorder:
                names.append("weight_g_idx")
            what = f"compressed-tensors {scheme.bits}-bit {scheme.type} {scheme.format}"
            self.require(module, what, names)
            dtype = self.header[f"{module}.{names[0]}"][0]
            expected = {"float": "F8_E4M3", "int": "I32" if scheme.format == "pack-quantized" else "I8"}[scheme.type]
            if dtype != expected:
                raise ValueError(f"{module}: {what} weights hold {names[0]} as {expected}, the checkpoint as {dtype}")


class CompressedTensorsLinearMethod(WeightOnlyLinearMethod):
    def __init__(self, scheme: Scheme):
        super().__init__()
        self.scheme = scheme
        self.format_name = f"compressed-tensors {'W%dA16' % scheme.bits if scheme.type == 'int' else 'fp8'}"

    def tensors(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> list[TensorSpec]:
        s, n, k = self.scheme, sum(output_sizes), input_size
        grouped = s.strategy in ("group", "block")
        size = s.group_size if s.strategy == "group" else s.block[1] if s.strategy == "block" else None
        # actorder on a row-parallel layer: this rank's inputs may be of any group, so every rank loads all scales
        whole = s.actorder and getattr(layer, "tp_dim", None) == 1 and layer.tp_size > 1
        if size is not None:
            if not whole:
                check_group_split(layer, size)
            if (k * layer.tp_size if whole else k) % size:
                raise ValueError(f"{layer.prefix}: its {k} inputs are not whole quantization groups of {size}")
        groups = (k * layer.tp_size if whole else k) // size if grouped else 1
        scale_in = 1 if grouped and not whole else None
        if s.type == "float":
            specs = [TensorSpec("weight", (n, k), torch.float8_e4m3fn, output_dim=0, input_dim=1)]
            if s.strategy == "tensor":
                specs.append(TensorSpec("weight_scale", None, torch.float32, per_part=True))
            elif s.strategy == "block":
                bo = s.block[0]
                specs.append(TensorSpec("weight_scale", (-(-n // bo), groups), torch.float32, output_dim=0,
                                        input_dim=1, packed_dim=0, packed_factor=bo))
            else:
                specs.append(TensorSpec("weight_scale", (n, groups), torch.float32, output_dim=0, input_dim=scale_in))
            return specs
        per = 32 // s.bits
        if s.format == "pack-quantized":
            specs = [TensorSpec("weight_packed", (n, k // per), torch.int32, output_dim=0, input_dim=1, packed_dim=1,
                                packed_factor=per),
                     TensorSpec("weight_shape", (2,), torch.int64, per_part=True)]
            zero = TensorSpec("weight_zero_point", (n // per, groups), torch.int32, output_dim=0, input_dim=scale_in,
                              packed_dim=0, packed_factor=per)
        else:
            specs = [TensorSpec("weight", (n, k), torch.int8, output_dim=0, input_dim=1)]
            zero = TensorSpec("weight_zero_point", (n, groups), torch.int32, output_dim=0, input_dim=scale_in)
        specs.append(TensorSpec("weight_scale", (n, groups), torch.float32, output_dim=0, input_dim=scale_in))
        if not s.symmetric:
            specs.append(zero)
        if s.actorder:
            specs.append(TensorSpec("weight_g_idx", (k,), torch.int64, input_dim=0, per_part=True))
        return specs

    def decode(self, layer: nn.Module, loaded: dict[str, torch.Tensor],
               per_part: dict[str, list[torch.Tensor]]) -> QuantizedWeight:
        s, n, k = self.scheme, sum(self.sizes), self.k
        scales = loaded.get("weight_scale")
        if s.type == "float":
            if s.strategy == "tensor":
                scales = torch.cat([p.reshape(1, 1).expand(size, 1) for p, size in
                                    zip(per_part["weight_scale"], self.sizes)])
            elif s.strategy == "block":
                scales = scales.repeat_interleave(s.block[0], 0)[:n]
            group = {"group": s.group_size, "block": s.block[1] if s.block else None}.get(s.strategy, k)
            return QuantizedWeight(loaded["weight"], scales, group)
        if s.format == "pack-quantized":
            tp = layer.tp_size
            for i, (shape, size) in enumerate(zip(per_part["weight_shape"], self.sizes)):
                full = (size * (tp if layer.tp_dim == 0 else 1), k * (tp if layer.tp_dim == 1 else 1))
                if tuple(shape.tolist()) != full:
                    raise ValueError(f"{layer.prefix}: part {i}'s weight_shape is {tuple(shape.tolist())}, expected {full}")
            offset = 1 << (s.bits - 1)  # pack_to_int32 stores value + offset
            values = unpack_int32(loaded["weight_packed"], s.bits, 1)[:, :k] - offset
            zeros = loaded.get("weight_zero_point")
            zeros = None if zeros is None else unpack_int32(zeros, s.bits, 0)[:n] - offset
        else:
            values, zeros = loaded["weight"].to(torch.int32), loaded.get("weight_zero_point")
        g_idx = shared_g_idx(layer, per_part, "weight_g_idx", scales.shape[1]) if s.actorder else None
        return QuantizedWeight(values, scales, s.group_size or k, zeros, g_idx)
