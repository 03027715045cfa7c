"""FusedDecode: CPU decode steps of a Llama-family model in C (kernels/cpu_decode.c), the CPU's
counterpart of CUDA graphs: the eager forward dispatches ~140 torch ops per layer, which cost more
than reading the weights at a few sequences and a good share of the step at more
(docs/performance.md, items 16-23).

Built once after the KV cache exists, from the model's own tensors (weights, norms, the rotary
cos/sin cache, the caches): pointers into them are laid out in ctypes structures that the C side
reads every step. Decode steps of at most MAX_ROWS sequences are one C call (matmuls included);
larger ones keep each layer's four matmuls on the layers' own linear methods (oneDNN) and do the
rest in four C calls per layer. Prefill steps run the same way, with the backend's attention (SDPA)
after the C rotary + KV store. Models it cannot describe keep the eager forward.
"""
import ctypes
import logging
import os
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.kernels import cpu_kernels
from nanovllm.models.decoder import DecoderForCausalLM
from nanovllm.utils.context import Context

# Decode batches up to this many sequences run as one C call; above it oneDNN's matmuls use the
# cores better than the C kernel (docs/performance.md, item 16).
MAX_ROWS = 2
DISABLE_ENV = "NANOVLLM_CPU_FUSED_DECODE"

logger = logging.getLogger(__name__)
c_int64, c_float, c_void_p = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class LinearDesc(ctypes.Structure):
    _fields_ = [("weight", c_void_p), ("bias", c_void_p), ("n", c_int64), ("k", c_int64), ("weight_type", c_int64)]


class LayerDesc(ctypes.Structure):
    _fields_ = [("input_norm", c_void_p), ("post_norm", c_void_p), ("q_norm", c_void_p), ("k_norm", c_void_p),
                ("qkv", LinearDesc), ("o", LinearDesc), ("gate_up", LinearDesc), ("down", LinearDesc),
                ("k_cache", c_void_p), ("v_cache", c_void_p)]


class ModelDesc(ctypes.Structure):
    _fields_ = [("num_layers", c_int64), ("hidden", c_int64), ("num_heads", c_int64), ("num_kv_heads", c_int64),
                ("head_dim", c_int64), ("intermediate", c_int64), ("block_size", c_int64), ("eps", c_float),
                ("scale", c_float), ("cos_sin", c_void_p), ("final_norm", c_void_p),
                ("layers", ctypes.POINTER(LayerDesc)), ("embed", c_void_p), ("embed_type", c_int64),
                ("head", LinearDesc)]


def pointer(t: torch.Tensor | None) -> int | None:
    """The address of a dense fp32 tensor (None stays None)."""
    if t is None:
        return None
    if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() == 0:
        raise ValueError(f"not a dense fp32 tensor: {t.dtype} {tuple(t.shape)}")
    return t.data_ptr()


def linear_desc(layer: nn.Module) -> LinearDesc:
    w = layer.weight
    if w.numel() == 0:
        raise ValueError(f"{type(layer).__name__} keeps no dense weight")
    n, k = w.shape
    return LinearDesc(w.data_ptr(), pointer(getattr(layer, "bias", None)), n, k, cpu_kernels.weight_type(w))


class FusedDecode:
    """The decode forward (the embedding lookup, every layer, the final norm and, in the one-call
    path, the LM head) and the prefill layers, in C where it can."""

    def __init__(self, model: DecoderForCausalLM, kernels: cpu_kernels.CpuKernels):
        self.kernels = kernels
        inner = model.model
        # NOTE: the modules also keep alive every tensor whose address the structures hold.
        self.modules = layers = list(inner.layers)
        self.final_norm = inner.norm
        self.embed = inner.embed_tokens
        self.lm_head = model.lm_head
        attn0 = layers[0].self_attn
        descs = []
        for layer in layers:
            a, mlp = layer.self_attn, layer.mlp
            descs.append(LayerDesc(
                pointer(layer.input_layernorm.weight), pointer(layer.post_attention_layernorm.weight),
                pointer(a.q_norm.weight) if a.use_qk_norm else None,
                pointer(a.k_norm.weight) if a.use_qk_norm else None,
                linear_desc(a.qkv_proj), linear_desc(a.o_proj), linear_desc(mlp.gate_up_proj), linear_desc(mlp.down_proj),
                pointer(a.attn.k_cache), pointer(a.attn.v_cache)))
        eps = {layer.input_layernorm.eps for layer in layers} | {inner.norm.eps}
        if attn0.use_qk_norm:
            eps |= {layer.self_attn.q_norm.eps for layer in layers} | {layer.self_attn.k_norm.eps for layer in layers}
        if len(eps) != 1:
            raise ValueError(f"the fused decode step takes one RMSNorm eps, the model has {sorted(eps)}")
        cos_sin = attn0.rotary_emb.cos_sin_cache
        self.max_position = cos_sin.shape[0]
        self.layers = (LayerDesc * len(descs))(*descs)
        table = self.embed.weight
        self.desc = ModelDesc(len(descs), inner.norm.weight.numel(), attn0.num_heads, attn0.num_kv_heads, attn0.head_dim,
                              layers[0].mlp.down_proj.weight.shape[1], attn0.attn.k_cache.shape[1], eps.pop(),
                              attn0.attn.scale, pointer(cos_sin), pointer(inner.norm.weight), self.layers,
                              table.data_ptr(), cpu_kernels.weight_type(table), linear_desc(self.lm_head))

    max_rows = MAX_ROWS

    def can_run(self, num_seqs: int, context: Context) -> bool:
        return context.attn_metadata.seqlens_k is not None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        """A decode step: the logits [num_seqs, vocab]."""
        meta = context.attn_metadata
        tables = meta.block_tables.to(torch.int32).contiguous()
        lens = meta.context_lens.to(torch.int32).contiguous()
        slots = context.slot_mapping.to(torch.int64).contiguous()
        positions = self.checked_positions(positions)
        num_seqs = input_ids.shape[0]
        step = (positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), lens.data_ptr(), num_seqs,
                tables.shape[1], meta.max_seqlen_k)
        if num_seqs <= self.max_rows:
            ids = input_ids.to(torch.int64).contiguous()
            logits = torch.empty(num_seqs, self.lm_head.weight.shape[0])
            failed = self.kernels.decode_forward(ctypes.byref(self.desc), ids.data_ptr(), *step, logits.data_ptr(),
                                                 torch.get_num_threads())
            if failed == 2:
                raise ValueError(f"a token id of {ids.tolist()} is outside the vocabulary ({logits.shape[1]})")
            if failed:
                raise MemoryError("the fused CPU decode step could not allocate its buffers")
            return logits
        k, desc = self.kernels, ctypes.byref(self.desc)

        def attend(i: int, layer: nn.Module, qkv: torch.Tensor) -> torch.Tensor:
            attn = torch.empty(qkv.shape[0], layer.self_attn.q_size)
            if k.decode_attention_layer(desc, i, qkv.data_ptr(), *step, attn.data_ptr(), torch.get_num_threads()):
                raise MemoryError("the fused CPU decode step could not allocate its buffers")
            return attn
        return self.lm_head(self.run_layers(self.embed(input_ids).contiguous(), attend))

    def can_run_prefill(self, context: Context) -> bool:
        """Prefill steps that store into the cache (the engine's; not the warm-up's)."""
        return context.slot_mapping is not None

    def run_prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        """A prefill step: run_layers with the rotary + KV store in C and the attention of the
        backend (SDPA over the new tokens, and over a cached prefix where there is one)."""
        embeds = self.embed(input_ids).contiguous()
        slots = context.slot_mapping.to(torch.int64).contiguous()
        positions = self.checked_positions(positions)
        k, desc, meta = self.kernels, ctypes.byref(self.desc), context.attn_metadata

        def attend(i: int, layer: nn.Module, qkv: torch.Tensor) -> torch.Tensor:
            a = layer.self_attn
            k.rope_store_layer(desc, i, qkv.data_ptr(), positions.data_ptr(), slots.data_ptr(), qkv.shape[0],
                               torch.get_num_threads())
            q, key, value = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
            shape = (qkv.shape[0], -1, a.head_dim)
            attn = a.attn
            return attn.backend.prefill(q.view(shape), key.view(shape), value.view(shape), attn.k_cache,
                                        attn.v_cache, meta, attn.scale).flatten(1, -1)
        return self.run_layers(embeds, attend)

    def checked_positions(self, positions: torch.Tensor) -> torch.Tensor:
        positions = positions.to(torch.int64).contiguous()
        if int(positions.max()) >= self.max_position:
            raise ValueError(f"position {int(positions.max())} is past the rotary cache ({self.max_position})")
        return positions

    def run_layers(self, embeds: torch.Tensor,
                   attend: Callable[[int, nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Each layer's matmuls through its own linear methods, norms and SiLU in C, and
        attend(layer index, layer, qkv [rows, q | k | v]) -> [rows, num_heads * head_dim] between."""
        k, desc, threads = self.kernels, ctypes.byref(self.desc), torch.get_num_threads()
        rows = embeds.shape[0]
        resid, xn = torch.empty_like(embeds), torch.empty_like(embeds)
        x = embeds
        for i, layer in enumerate(self.modules):
            a, mlp = layer.self_attn, layer.mlp
            k.decode_add_rms_norm(desc, x.data_ptr(), resid.data_ptr(), i == 0, layer.input_layernorm.weight.data_ptr(),
                                  rows, xn.data_ptr(), threads)
            x = a.o_proj(attend(i, layer, a.qkv_proj(xn).contiguous()).contiguous()).contiguous()
            k.decode_add_rms_norm(desc, x.data_ptr(), resid.data_ptr(), 0,
                                  layer.post_attention_layernorm.weight.data_ptr(), rows, xn.data_ptr(), threads)
            gate_up = mlp.gate_up_proj(xn).contiguous()
            act = torch.empty(rows, gate_up.shape[1] // 2)
            k.decode_silu_mul(gate_up.data_ptr(), rows, act.shape[1], act.data_ptr(), threads)
            x = mlp.down_proj(act).contiguous()
        out = torch.empty_like(embeds)
        k.decode_add_rms_norm(desc, x.data_ptr(), resid.data_ptr(), 0, self.final_norm.weight.data_ptr(), rows,
                              out.data_ptr(), threads)
        return out


def build_fused_decode(model: nn.Module, backend_name: str, kv_dtype: torch.dtype, tp_size: int) -> FusedDecode | None:
    """A FusedDecode of model, or None where it does not apply (not a Llama-family decoder, tensor
    parallel, another attention backend or KV dtype, layers without dense weights, no C compiler,
    NANOVLLM_CPU_FUSED_DECODE=0); the eager forward then runs every step."""
    if os.environ.get(DISABLE_ENV, "1").lower() in ("0", "false", "off", "no"):
        return None
    if not isinstance(model, DecoderForCausalLM) or tp_size != 1 or backend_name != "torch" \
            or kv_dtype != torch.float32:
        return None
    kernels = cpu_kernels.load()
    if kernels is None:
        return None
    try:
        return FusedDecode(model, kernels)
    except ValueError as e:
        logger.info("decode steps run the eager forward: %s", e)
        return None
