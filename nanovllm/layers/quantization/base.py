"""The seat of a weight format: a QuantizationConfig (what a checkpoint says about its weights)
gives each layer, at construction, a method that creates the layer's parameters, turns them after
loading into the form it multiplies from, and multiplies (vLLM's QuantizationConfig /
LinearMethodBase). Platforms answer only which kernels the machine has (LinearKernels)."""
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from nanovllm.kernels.cpu_kernels import CpuKernels


@dataclass(frozen=True)
class LinearKernels:
    """What the machine offers the methods, decided once per model by the platform
    (Platform.linear_kernels): each method picks its kernel from it."""

    onednn_packing: bool = False          # fp32 weights reordered once into oneDNN's blocked layout
    transposed_when_wide: bool = False    # MKL: x W^T as (W x^T)^T where output >= input
    c_kernels: "CpuKernels | None" = None  # the C library (kernels/cpu_kernels.py): dense weights read there
    c_weight_dtype: torch.dtype = torch.float32  # how a dense weight for the C kernels is held
    # Block-format and pre-quantized weights multiplied by the Triton weight-only kernels (a GPU,
    # or the Triton interpreter where NANOVLLM_TRITON_WEIGHT_ONLY=1 asks for them on a CPU).
    triton_weight_only: bool = False
    fused_moe_triton: bool = False        # dense experts run by the Triton grouped kernel (a GPU)
    state_triton: bool = False            # state layers' decode steps in Triton (kernels/triton_deltanet.py; a GPU)
    lora_triton: bool = False             # LoRA updates by the Triton BGMV kernels (kernels/triton_lora.py; a GPU)


@dataclass(frozen=True)
class CWeightView:
    """A weight matrix as the C kernels stream it (kernels/cpu_kernels.h, `Linear`): n rows of
    row_bytes each, in the C weight-type table's row `type_name`, plus format-specific side data."""

    type_name: str
    data: torch.Tensor
    n: int
    k: int
    row_bytes: int
    scales: torch.Tensor | None = None
    next: "CWeightView | None" = None  # the matrix whose rows give the outputs after these n (a stacked
                                       # layer whose parts are held in different formats)
    # block formats' input rounding (config.CPU_INPUT_BITS): 0 per group, 1 int8, 2 two int8 planes
    input_planes: int = 0

    @property
    def outputs(self) -> int:
        """The outputs of this matrix and those chained after it."""
        return self.n + (self.next.outputs if self.next is not None else 0)


class QuantizeMethodBase:
    """How one layer holds and reads its weights."""

    name: str = "?"
    # Whether the C kernels of its c_view are its only kernels (no oneDNN path that wins at larger
    # batches): the decode step then runs in one C call at every batch size.
    c_only: bool = False

    def process_weights_after_loading(self, layer: nn.Module, kernels: LinearKernels, is_shared: bool) -> None:
        """Turn the loaded parameters into the form apply() reads, once. is_shared: another module
        uses the same parameter (a tied embedding table), so its loaded form must stay usable."""

    def c_view(self, layer: nn.Module) -> CWeightView | None:
        """The weights as the C decode step reads them, or None: the layer then runs its own
        module inside the step (executor/cpu_decode.py)."""
        return None

    def streamed_weights(self, layer: nn.Module) -> list[torch.Tensor]:
        """The tensors one multiplication reads (for the memory-floor estimate, utils/efficiency.py)."""
        return []


class LinearMethodBase(QuantizeMethodBase):
    # Whether an LM head with this method may multiply by the embedding's table (tie_word_embeddings).
    # A head the checkpoint quantized on its own keeps its own tensors.
    may_tie: bool = True

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        """Register the layer's parameters for this rank's [sum(output_partition_sizes), input_size]
        weight through layer.register_weight, each tagged with its output / input / packed dims."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [num_tokens, input_size] -> x W^T (+ bias) [num_tokens, output_size]."""
        raise NotImplementedError


class EmbeddingMethodBase(QuantizeMethodBase):
    def create_weights(self, layer: nn.Module, num_embeddings: int, embedding_dim: int,
                       params_dtype: torch.dtype) -> None:
        raise NotImplementedError

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the table for ids (all within this rank's slice), in layer.dtype."""
        raise NotImplementedError


class FusedMoEMethodBase(QuantizeMethodBase):
    """How a mixture-of-experts layer (layers/moe.py, FusedMoE) holds and runs its experts."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int,
                       params_dtype: torch.dtype) -> None:
        """Register the stacked experts' parameters (this rank's intermediate_size)."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden] -> the routed experts' weighted sum [num_tokens, hidden] (this rank's part)."""
        raise NotImplementedError

    def c_struct(self, layer: nn.Module):
        """The experts as the C decode step runs them (kernels/cpu_kernels.py, MoeExperts), or None."""
        return None


class QuantizationConfig:
    """One weight format of a checkpoint. Subclasses register under a name (the package's
    registry), the value of config.json's quantization_config.quant_method they answer to.

    A layer asks for its method at construction by its kind; None means the layer keeps dense
    weights (ignored modules such as an unquantized lm_head, routers)."""

    name: ClassVar[str]
    # How the CPU block kernels round a layer's inputs (CWeightView.input_planes), given at
    # construction from Config.cpu_input_bits; the block-format methods pass it on.
    input_planes: int = 0

    @classmethod
    def from_model(cls, path: str, hf_config: Any, packed_modules_mapping: dict) -> "QuantizationConfig | None":
        """This format's config for the checkpoint at path, or None when it is not in this format.
        packed_modules_mapping: the model's stacked layers (checkpoint module -> (layer, shard))."""
        raise NotImplementedError

    def check_device(self, device: str, hf_config: Any) -> None:
        """ValueError where the format's kernels cannot run this model on the device (Config.device)."""

    def check_tensor_parallel(self, tp_size: int, row_parallel_inputs: dict[str, int]) -> None:
        """Before any rank starts: ValueError naming the first weight tp_size ranks would cut inside a
        block or group. row_parallel_inputs: the model's row-parallel layers and their inputs."""

    def linear_method(self, layer: nn.Module, prefix: str) -> "LinearMethodBase | None":
        """The method of the linear layer named prefix (e.g. "model.layers.0.mlp.down_proj")."""
        return None

    def lm_head_method(self, layer: nn.Module, prefix: str) -> "LinearMethodBase | None":
        """The LM head's method (a tied head multiplies by the embedding's table); dense unless the
        format says otherwise, as most checkpoints keep the head."""
        return None

    def embedding_method(self, layer: nn.Module, prefix: str) -> "EmbeddingMethodBase | None":
        return None

    def moe_method(self, layer: nn.Module, prefix: str) -> "FusedMoEMethodBase | None":
        """The method of a mixture-of-experts layer (its experts stacked under prefix)."""
        return None


# The dense method of each kind (unquantized.py registers them): what a layer gets where its
# config gives none. NOTE: the package's __init__ imports unquantized.py, so they are registered
# before any layer can be built.
_DENSE_METHODS: dict[str, type[QuantizeMethodBase]] = {}
_KINDS = {"linear_method": LinearMethodBase, "lm_head_method": LinearMethodBase,
          "embedding_method": EmbeddingMethodBase, "moe_method": FusedMoEMethodBase}


def register_dense_method(kind: type[QuantizeMethodBase]):
    """Class decorator: the dense method of its kind (LinearMethodBase, EmbeddingMethodBase, ...)."""
    def register(cls: type[QuantizeMethodBase]) -> type[QuantizeMethodBase]:
        _DENSE_METHODS[kind.__name__] = cls
        return cls
    return register


def method_for(quant_config: QuantizationConfig | None, request: str, layer: nn.Module,
               prefix: str) -> QuantizeMethodBase:
    """quant_config's answer to request ("linear_method", "lm_head_method", "embedding_method",
    "moe_method") for the layer, or the dense method of that kind where it gives none."""
    kind = _KINDS[request]
    method = getattr(quant_config, request)(layer, prefix) if quant_config is not None else None
    if method is None:
        return _DENSE_METHODS[kind.__name__]()
    if not isinstance(method, kind):
        raise TypeError(f"{type(quant_config).__name__} gave {prefix!r} a {type(method).__name__}, "
                        f"not a {kind.__name__}")
    return method
