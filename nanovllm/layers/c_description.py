"""How a layer describes itself to the CPU's C decode step (kernels/cpu_kernels.h's structures).

Each module class the C step can run registers a describer where the class is defined
(`@describes(Class)`), and the executor's walker (executor/cpu_decode.py) asks `describe()` for each
part it meets, knowing no model class. A describer returns what its part adds to the C structures,
by field name (CPart), or raises NotInC naming the part and why the C step cannot run it; a class
with no describer is not run in C. A describer applies to its own class only, unless registered with
subclasses=True: a subclass that computes something else (Gemma's norm, a LoRA-wrapped projection)
says so by registering its own.
"""
import ctypes
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from nanovllm.kernels import cpu_kernels
from nanovllm.kernels.cpu_structs import Linear


class NotInC(ValueError):
    """A part the C step cannot run; the message names it and the reason."""


_DESCRIBERS: dict[type, tuple[Callable, bool]] = {}
REGISTERED_IN: dict[type, str] = {}  # the module each registration was made in (tests/tools/test_structure.py)


def describes(cls: type, *, subclasses: bool = False):
    """Register the decorated function(module, c: CDescriber) as the C description of cls's modules
    (and of its subclasses' when subclasses=True). Made where cls is defined."""
    where = sys._getframe(1).f_globals.get("__name__", "?")

    def register(fn: Callable) -> Callable:
        _DESCRIBERS[cls] = (fn, subclasses)
        REGISTERED_IN[cls] = where
        return fn
    return register


def by_field(struct: type[ctypes.Structure], fields: dict) -> ctypes.Structure:
    """struct built from fields by name (the others zero); ValueError for a name it lacks (ctypes
    would keep it as a plain attribute, and the C side would never see it)."""
    unknown = sorted(set(fields) - {name for name, *_ in struct._fields_})
    if unknown:
        raise ValueError(f"{struct.__name__} has no field {unknown}")
    return struct(**fields)


def describer_of(module: nn.Module) -> Callable | None:
    for i, cls in enumerate(type(module).__mro__):
        entry = _DESCRIBERS.get(cls)
        if entry is not None and (i == 0 or entry[1]):
            return entry[0]
    return None


def describe(module: nn.Module, c: "CDescriber", what: str):
    """module's C description (its describer's answer); NotInC when its class has none, or when its
    describer finds it cannot run (the reason prefixed with what, the part's path: "layer 1: its
    attention: ...")."""
    fn = describer_of(module)
    if fn is None:
        raise NotInC(f"{what} ({type(module).__name__}) has no C description")
    try:
        return fn(module, c)
    except NotInC as e:
        raise NotInC(f"{what}: {e}") from None


@dataclass
class Phases:
    """A layer's parts that the C step runs between torch's matmuls, where some matrix of the
    layer has no C view: q|k|v projection, attention, o projection, then the MLP either split
    (gate_up, SiLU in C, down) or called whole."""
    qkv: nn.Module | None = None
    o: nn.Module | None = None
    attention: nn.Module | None = None  # layers/attention.py's Attention (its cache, backend, window)
    q_size: int = 0
    kv_size: int = 0
    head_dim: int = 0
    gate_up: nn.Module | None = None
    down: nn.Module | None = None
    mlp: nn.Module | None = None


@dataclass
class CPart:
    """What a part adds to its layer's C structure (cpu_structs.DecoderLayer's fields by name), and
    what the walker needs to know about it."""
    fields: dict = field(default_factory=dict)
    in_c: bool = True  # every matrix has a C view: the one call can run it whole
    one_call_only: bool = False  # no phases between torch's matmuls (a hybrid's layer kinds)
    # The model-wide settings its attention asks for (cpu_structs.DecoderModel's fields by name):
    # every attention layer of a model must ask the same.
    model_fields: dict = field(default_factory=dict)
    max_position: int = 0  # positions of the rotary cache its attention reads (0: none)
    phases: Phases = field(default_factory=Phases)

    def merged(self, *others: "CPart") -> "CPart":
        """This part and others as one (a layer of its parts): fields and model fields united,
        in C only if all are, one call only if any is."""
        out = CPart(dict(self.fields), self.in_c, self.one_call_only, dict(self.model_fields), self.max_position,
                    Phases(**vars(self.phases)))
        for other in others:
            out.fields.update(other.fields)
            out.model_fields.update(other.model_fields)
            out.in_c = out.in_c and other.in_c
            out.one_call_only = out.one_call_only or other.one_call_only
            out.max_position = other.max_position or out.max_position
            for name, value in vars(other.phases).items():
                if value is not None and value != 0:
                    setattr(out.phases, name, value)
        return out


@dataclass
class CModel:
    """A causal LM as the C step walks it: its layers in order, the final norm, embedding and head;
    Granite's multipliers (the embedding rows times embed_scale, each branch times residual_scale as
    it joins the stream, the logits times logit_scale)."""
    layers: list
    norm: nn.Module
    embed: nn.Module
    head: nn.Module
    embed_scale: float = 1.0
    residual_scale: float = 1.0
    logit_scale: float = 1.0


def pointer(t: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> int | None:
    """The address of a dense tensor of dtype (None stays None)."""
    if t is None:
        return None
    if t.dtype != dtype or not t.is_contiguous() or t.numel() == 0:
        raise ValueError(f"not a dense {dtype} tensor: {t.dtype} {tuple(t.shape)}")
    return t.data_ptr()


class CDescriber:
    """What describers share while one model is described: the C kernels, the tensors made for the
    structures (kept alive as long as this), and the norms' eps (the C step takes one)."""

    def __init__(self, kernels: cpu_kernels.CpuKernels):
        self.kernels = kernels
        self.kept: list = []
        self.eps: set[float] = set()

    def keep(self, t: torch.Tensor) -> int:
        """The address of a tensor made for the structures, kept alive here."""
        self.kept.append(t)
        return pointer(t)

    def linear(self, module: nn.Module, what: str) -> Linear | None:
        """The C description of a linear layer or embedding (its describer's), None where its weights
        have no C view. NOTE: kept here: a structure's copy of it points at its chained parts."""
        linear = describe(module, self, what)
        if linear is not None:
            self.kept.append(linear)
        return linear

    def norm(self, module: nn.Module, what: str) -> int:
        """The address of a norm's multiplier."""
        return describe(module, self, what)

    def struct_pointer(self, struct: ctypes.Structure):
        """A pointer field's value for struct (kept alive here)."""
        self.kept.append(struct)
        return ctypes.pointer(struct)


def weight_view(module: nn.Module, c: CDescriber) -> Linear | None:
    """A linear layer's or embedding's C description: its method's view of its weights (with its
    bias), or None where the method has none."""
    view = module.quant_method.c_view(module)
    return None if view is None else cpu_kernels.linear_struct(c.kernels, view, getattr(module, "bias", None))
