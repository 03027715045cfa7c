"""A mixture of experts' stacked experts in GGUF block formats (layers/moe.py, FusedMoE): from a
.gguf file's 3-D expert tensors (ffn_gate_exps / ffn_up_exps / ffn_down_exps, raw block rows as
stored; loader/gguf.py hands them over expert by expert), or quantized at load from a dense
checkpoint (quantization="q8_0" | ...), each expert's matrices by the same quantizers as the dense
layers (quantizers.py, quantize_rows).

Held once: w13 uint8 [E, 2I, row bytes of H inputs] (each expert's gate rows, then up rows) and w2
uint8 [E, H, row bytes of I inputs], each expert's rows interleaved by 8 in place where its format
has that layout; the C experts kernel (kernels/cpu_moe.c) multiplies from them with the dense
layers' integer kernels, reading only the experts some row chose. On a GPU (or the Triton
interpreter, NANOVLLM_TRITON_WEIGHT_ONLY=1) the experts are held in the Triton weight-only kernel's
packed layout instead (gguf_triton.hold per expert: MXFP4 as 4-bit codes and a scale per 32) and
multiplied by the Triton experts kernel (kernels/fused_moe.py), which dequantizes tile by tile."""
import torch
from torch import nn

from nanovllm.kernels import cpu_kernels
from nanovllm.layers.quantization.base import CWeightView, FusedMoEMethodBase, LinearKernels
from nanovllm.layers.quantization.block_formats import row_bytes
from nanovllm.layers.quantization.gguf_dense import dequantized
from nanovllm.layers.quantization.moe_ops import activate, c_experts, experts_reference, route
from nanovllm.layers.quantization.quantizers import quantize_rows


class GGUFFusedMoEMethod(FusedMoEMethodBase):
    """types: (the gate/up format, the down format). online: the checkpoint gives dense experts."""

    c_only = True

    def __init__(self, types: tuple[str, str], online: bool = False, input_planes: int = 0):
        self.types = types
        self.online = online
        self.input_planes = input_planes  # CWeightView.input_planes
        self.c_kernels = None
        self.c_moe = None
        self.triton_experts = None  # (w13, w2) packed for kernels/fused_moe.py

    @property
    def name(self) -> str:
        if self.triton_experts is not None:
            return f"experts {'/'.join(dict.fromkeys(self.types))} (Triton kernel)"
        if self.c_kernels is None and self.c_moe is None and not self.c_only:
            return f"experts {'/'.join(dict.fromkeys(self.types))} (dequantized, torch)"
        return f"experts {'/'.join(dict.fromkeys(self.types))} (C kernel{', quantized at load' if self.online else ''})"

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int,
                       params_dtype: torch.dtype) -> None:
        what = getattr(layer, "prefix", "experts")
        shapes = {"w13_weight": (2 * intermediate_size, hidden_size, self.types[0]),
                  "w2_weight": (hidden_size, intermediate_size, self.types[1])}
        self.params_dtype = params_dtype
        for name, (rows, k, type_name) in shapes.items():
            width = row_bytes(type_name, k, f"{what} ({name[:-7]})")  # whole blocks per rank, else ValueError
            data = torch.empty(num_experts, rows, k, dtype=params_dtype) if self.online else \
                torch.empty(num_experts, rows, width, dtype=torch.uint8)
            layer.register_weight(name, data, output_dim=1, input_dim=2)

    def process_weights_after_loading(self, layer: nn.Module, kernels: LinearKernels, is_shared: bool) -> None:
        if kernels.triton_weight_only:
            self.hold_for_triton(layer)
            return
        self.c_kernels = kernels.c_kernels
        views = []
        for param, type_name, k in ((layer.w13_weight, self.types[0], layer.hidden_size),
                                    (layer.w2_weight, self.types[1], layer.intermediate_size)):
            if self.online:  # expert by expert, so the dense copy and one expert's blocks are all that coexist
                param.data = torch.stack([quantize_rows(param.data[e], type_name) for e in range(param.shape[0])])
            if self.c_kernels is None:  # the rule without C kernels (gguf_dense.py): the grouped torch loop
                param.data = torch.stack([dequantized(param.data[e], type_name, k, self.params_dtype)
                                          for e in range(param.shape[0])])
                continue
            held_type = type_name
            for e in range(param.shape[0]):
                packed = cpu_kernels.interleaved(self.c_kernels, type_name, param.data[e], k)
                if packed is not None:
                    held_type = packed[0]
                    param.data[e] = packed[1]
            views.append([CWeightView(held_type, param.data[e], param.shape[1], k, param.shape[2],
                                      input_planes=self.input_planes)
                          for e in range(param.shape[0])])
        if self.c_kernels is None:
            self.c_only = False
            return
        self.c_moe = c_experts(self.c_kernels, layer, views[0], views[1])

    def hold_for_triton(self, layer: nn.Module) -> None:
        """Each expert's rows unpacked once into the Triton kernel's layout, stacked; the raw rows dropped."""
        from nanovllm.kernels.triton_weight_only import stack_experts
        from nanovllm.layers.quantization.gguf_triton import hold
        self.c_only = False
        held = []
        for param, type_name, k in ((layer.w13_weight, self.types[0], layer.hidden_size),
                                    (layer.w2_weight, self.types[1], layer.intermediate_size)):
            rows = [quantize_rows(param.data[e], type_name) if self.online else param.data[e]
                    for e in range(param.shape[0])]
            held.append(stack_experts([hold(r.to(param.device), type_name, k, self.params_dtype) for r in rows]))
            param.data = torch.empty(0, dtype=torch.uint8, device=param.device)
        self.triton_experts = tuple(held)

    def apply(self, layer: nn.Module, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if self.triton_experts is not None:
            from nanovllm.kernels.fused_moe import fused_experts
            weights, ids = route(layer, router_logits)
            return fused_experts(x, *self.triton_experts, weights, ids, layer.biases,
                                 lambda gate, up: activate(gate, up, layer.activation))
        if self.c_moe is None:  # dequantized: no C kernels here
            weights, ids = route(layer, router_logits)
            return experts_reference(x, layer.w13_weight, layer.w2_weight, weights, ids, layer.biases,
                                     layer.activation)
        dtype = x.dtype
        y = cpu_kernels.moe_experts(self.c_kernels, self.c_moe, x.to(torch.float32), router_logits)
        return y if dtype == torch.float32 else y.to(dtype)

    def c_struct(self, layer: nn.Module):
        return self.c_moe

    def streamed_weights(self, layer: nn.Module) -> list[torch.Tensor]:
        if self.triton_experts is not None:
            return [t for w in self.triton_experts for t in (w.q, w.scales, w.zeros, w.mins) if t is not None]
        return [layer.w13_weight, layer.w2_weight]
