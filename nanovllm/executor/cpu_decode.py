"""FusedDecode: CPU decode steps of a Llama-family model in C (kernels/cpu_decode.c), the CPU's
counterpart of CUDA graphs: the eager forward dispatches ~140 torch ops per layer, which cost more
than reading the weights at a few sequences and a good share of the step at more
(docs/performance.md, items 16-23).

Built once after the KV cache exists, from the model's own tensors: each linear layer (and the
embedding) gives a C view of its weights through its method, or None (executor/cpu_descriptions.py);
norms, the rotary cos/sin cache and the caches are read directly. Pointers are laid out in ctypes structures
(kernels/cpu_kernels.py) that the C side reads every step. Decode steps of any batch (of
cpu_kernels.MAX_ROWS where some layer's weights are read by torch) run each range of layers whose
weights all have views (and whose MLP is the gated one or a sparse MoE block,
kernels/cpu_moe.c) as one C call; a layer without them runs its own modules between the C phases.
Larger decode steps and prefill steps run every layer that way: the matmuls on the layers' own
methods, norms, rotary + KV store, attention (decode) and SiLU in C.

The hybrids (Qwen3.5, Qwen3-Next: models/qwen3_next.py) run their decode steps in the one call
only: their gated attention (partial rotary, an output gate) and Gated DeltaNet layers (the
delta rule on each sequence's state slot, kernels/cpu_deltanet.c) have no phases of their own
between torch's matmuls, so their prefill steps and batches past the one call's rows run eager.
"""
import ctypes
import logging
import os
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.executor.cpu_descriptions import described, layer_linears, linear_attention, pointer, segments
from nanovllm.executor.step_runner import StepRunner
from nanovllm.kernels import cpu_kernels
from nanovllm.layers.activation import SiluAndMul
from nanovllm.kernels.cpu_structs import DecoderLayer, DecoderModel, DecodeStep, Linear, MoeExperts
from nanovllm.layers.layernorm import GemmaRMSNorm
from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.models.decoder import DecoderAttention, DecoderForCausalLM, GatedMLP
from nanovllm.models.qwen3_next import GatedAttention
from nanovllm.utils.context import Context

DISABLE_ENV = "NANOVLLM_CPU_FUSED_DECODE"

logger = logging.getLogger(__name__)


class FusedDecode(StepRunner):
    """The decode forward (the embedding lookup, every layer, the final norm and, in the one-call
    path, the LM head) and the prefill layers, in C where it can."""

    max_rows = cpu_kernels.MAX_ROWS

    def __init__(self, model: DecoderForCausalLM, kernels: cpu_kernels.CpuKernels):
        self.kernels = kernels
        inner = model.model
        # NOTE: the modules also keep alive every tensor whose address the structures hold (and
        # self.kept the ones made here).
        self.modules = layers = list(inner.layers)
        self.kept: list[torch.Tensor] = []
        self.final_norm = inner.norm
        self.final_norm_weight = self.norm_weight(inner.norm)
        self.embed = inner.embed_tokens
        self.lm_head = model.lm_head
        self.compute_logits = model.compute_logits
        attention_layers = [layer for layer in layers if linear_attention(layer) is None]
        if not attention_layers:
            raise ValueError("no attention layer")
        if not all(isinstance(layer.self_attn, (DecoderAttention, GatedAttention)) for layer in attention_layers):
            raise ValueError("a layer's attention is not the shared decoder attention")
        if any(layer.self_attn.attn.logit_softcap is not None for layer in attention_layers):
            raise ValueError("soft-capped attention (the C decode step's softmax has no cap)")
        if not all(isinstance(getattr(layer.mlp, "act_fn", SiluAndMul()), SiluAndMul) for layer in layers):
            raise ValueError("an MLP's activation is not SiLU (the C decode step's)")
        attn0 = attention_layers[0].self_attn
        # The hybrids' layer kinds run in the one call only (no phases between torch's matmuls).
        self.hybrid = any(isinstance(layer.self_attn, GatedAttention) for layer in attention_layers) \
            or len(attention_layers) < len(layers)
        descs, in_c = [], []
        # NOTE: the structures below hold copies of these descriptions, whose chained parts (a
        # stacked layer's parts in other formats) live in the originals: kept for as long as self.
        self.linears: list[Linear] = []
        self.moes: list[MoeExperts] = []
        eps = {inner.norm.eps}
        for layer in layers:
            parts = layer_linears(kernels, layer)
            linears, moe = parts or ([Linear()] * 4, None)
            self.linears += linears
            self.moes += [moe] if moe is not None else []
            in_c.append(parts is not None)
            norms = [self.norm_weight(layer.input_layernorm), self.norm_weight(layer.post_attention_layernorm)]
            eps |= {layer.input_layernorm.eps, layer.post_attention_layernorm.eps}
            lin = linear_attention(layer)
            if lin is not None:
                eps.add(lin.norm.eps)
                if lin.c_desc is None:
                    raise ValueError("a linear-attention layer has no C description (no state slots for the C kernels)")
                descs.append(DecoderLayer(*norms, None, None, *linears, None, None, int(parts is not None),
                                          ctypes.pointer(moe) if moe is not None else None, 0, None, 0, 0,
                                          ctypes.pointer(lin.c_desc)))
                continue
            a = layer.self_attn
            qk_norms = [None, None]
            if getattr(a, "use_qk_norm", True):  # the gated attention always norms q and k
                qk_norms = [self.norm_weight(a.q_norm), self.norm_weight(a.k_norm)]
                eps |= {a.q_norm.eps, a.k_norm.eps}
            descs.append(DecoderLayer(
                *norms, *qk_norms, *linears, pointer(a.attn.k_cache, a.attn.kv_format.storage),
                pointer(a.attn.v_cache, a.attn.kv_format.storage), int(parts is not None),
                ctypes.pointer(moe) if moe is not None else None, a.attn.sliding_window or 0,
                pointer(a.attn.sinks), a.attn.kv_group, int(isinstance(a, GatedAttention)), None))
        if self.hybrid and not all(in_c):
            raise ValueError("a hybrid model's layer has a matrix without a C view (its layers run in the one call only)")
        if len(eps) != 1:
            raise ValueError(f"the fused decode step takes one RMSNorm eps, the model has {sorted(eps)}")
        cos_sin = attn0.rotary_emb.cos_sin_cache
        self.max_position = cos_sin.shape[0]
        self.segments = segments(in_c)
        self.layers = (DecoderLayer * len(descs))(*descs)
        embed, head = described(kernels, self.embed), described(kernels, self.lm_head)
        self.linears += [lin for lin in (embed, head) if lin is not None]
        self.embed_in_c, self.head_in_c = embed is not None, head is not None
        intermediate = max([d.down.k for d in descs if d.in_c] + [moe.shared_down.k for moe in self.moes], default=0)
        self.desc = DecoderModel(len(descs), inner.norm.weight.numel(), attn0.num_heads, attn0.num_kv_heads,
                                 attn0.head_dim, intermediate, attn0.attn.k_cache.shape[1],
                                 attn0.attn.kv_format.c_type, eps.pop(), attn0.attn.scale,
                                 attn0.rotary_emb.rotary_dim, pointer(cos_sin), self.final_norm_weight, self.layers,
                                 embed or Linear(), head or Linear())
        bad = kernels.decode_check_model(ctypes.byref(self.desc))
        if bad >= 0:
            raise ValueError(f"the C description of {'layer %d' % bad if bad < len(descs) else 'the embedding or head'}"
                             " is not valid")
        self.one_call_layers = sum(in_c)
        # Every matmul on the C kernels alone (block formats, dense fp32 / bf16: no torch path to
        # hand larger batches to): the step is one C call at every batch size, not only up to MAX_ROWS.
        # (A MoE router or shared-expert gate is a dense [E, H] / [1, H] matrix: too small to matter.)
        methods = [m.quant_method for layer in layers for m in layer.modules()
                   if hasattr(m, "quant_method") and not isinstance(m, ReplicatedLinear)]
        methods += [self.embed.quant_method, self.lm_head.quant_method]
        if all(in_c) and self.head_in_c and all(method.c_only for method in methods):
            self.max_rows = cpu_kernels.ALL_ROWS

    def norm_weight(self, norm: nn.Module) -> int:
        """The address of an RMSNorm's multiplier: its weight, or 1 + weight for Gemma's form (a copy
        kept here)."""
        if isinstance(norm, GemmaRMSNorm):
            self.kept.append((1.0 + norm.weight.float()).contiguous())
            return pointer(self.kept[-1])
        return pointer(norm.weight)

    def can_run(self, num_tokens: int, context: Context) -> bool:
        if self.hybrid:  # decode steps in the one call, each sequence with its state slot
            return (not context.is_prefill and num_tokens <= self.max_rows and context.state is not None
                    and context.state.slots is not None)
        if context.is_prefill:  # steps that store into the cache (the engine's; not the warm-up's)
            return context.slot_mapping is not None
        return context.attn_metadata.seqlens_k is not None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context,
            logits_indices: torch.Tensor | None) -> torch.Tensor | None:
        if not context.is_prefill:
            return self.run_decode(input_ids, positions, context)
        hidden_states = self.run_prefill(input_ids, positions, context)
        return self.compute_logits(hidden_states if logits_indices is None else hidden_states[logits_indices])

    def run_decode(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        """A decode step: the logits [num_seqs, vocab]."""
        positions = self.checked_positions(positions)
        num_seqs = input_ids.shape[0]
        # One step per KV group (engine/kv_groups.py): its block tables and slots.
        # NOTE: the steps point into these tensors: they live until the step returns.
        held, steps = [], []
        state_slots = None
        if context.state is not None and context.state.slots is not None:
            state_slots = context.state.slots.to(torch.int64).contiguous()
            held.append(state_slots)
        for g in range(1 + len(context.more_groups)):
            slot_mapping, meta = context.kv_inputs(g)
            tables = meta.block_tables.to(torch.int32).contiguous()
            lens = meta.context_lens.to(torch.int32).contiguous()
            slots = slot_mapping.to(torch.int64).contiguous()
            held += [tables, lens, slots]
            steps.append(DecodeStep(positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                                    num_seqs, tables.shape[1], meta.max_seqlen_k, int(context.shared_rows),
                                    None if state_slots is None else state_slots.data_ptr()))
        steps = (DecodeStep * len(steps))(*steps)
        k, desc, step_ref = self.kernels, ctypes.byref(self.desc), ctypes.byref(steps)

        def attend(i: int, layer: nn.Module, qkv: torch.Tensor) -> torch.Tensor:
            attn = torch.empty(qkv.shape[0], layer.self_attn.q_size)
            if k.decode_attention_layer(desc, i, qkv.data_ptr(), step_ref, attn.data_ptr(), torch.get_num_threads()):
                raise MemoryError("the fused CPU decode step could not allocate its buffers")
            return attn
        if num_seqs <= self.max_rows:
            return self.run_one_call(input_ids, step_ref, attend)
        return self.lm_head(self.run_layers(self.embed(input_ids).contiguous(), attend))

    def run_one_call(self, input_ids: torch.Tensor, step_ref,
                     attend: Callable[[int, nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Each run of C-described layers one C call (the embedding and LM head inside where they
        have views), the other layers through run_layer."""
        rows, hidden_size = input_ids.shape[0], self.desc.hidden
        ids = input_ids.to(torch.int64).contiguous()
        # The C call looks the ids up only when it runs the first layer.
        embed_in_c = self.embed_in_c and self.segments[0][2]
        hidden = self.embed(ids).contiguous() if not embed_in_c else torch.empty(rows, hidden_size)
        resid = torch.empty(rows, hidden_size)
        started = False
        for first, end, in_c in self.segments:
            if not in_c:
                for i in range(first, end):
                    hidden = self.run_layer(i, hidden, resid, started, attend)
                    started = True
                continue
            logits = (torch.empty(rows, self.desc.head.n) if end == len(self.modules) and self.head_in_c
                      else None)
            failed = self.kernels.decode_layers(
                ctypes.byref(self.desc), step_ref, ids.data_ptr() if first == 0 and embed_in_c else None,
                first, end, hidden.data_ptr(), resid.data_ptr(), started,
                None if logits is None else logits.data_ptr(), torch.get_num_threads())
            if failed == 2:
                raise ValueError(f"a token id of {ids.tolist()} is outside the vocabulary ({self.desc.embed.n})")
            if failed:
                raise MemoryError(f"the fused CPU decode step failed ({failed}: 1 no memory, 3 bad range)")
            if logits is not None:
                return logits
            started = True
        return self.lm_head(self.final_normed(hidden, resid))

    def run_prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        """A prefill step: run_layers with the rotary + KV store in C and the attention of the
        backend (SDPA over the new tokens, and over a cached prefix where there is one)."""
        embeds = self.embed(input_ids).contiguous()
        groups = [context.kv_inputs(g) for g in range(1 + len(context.more_groups))]
        slots = [slot_mapping.to(torch.int64).contiguous() for slot_mapping, _ in groups]
        positions = self.checked_positions(positions)
        k, desc = self.kernels, ctypes.byref(self.desc)

        def attend(i: int, layer: nn.Module, qkv: torch.Tensor) -> torch.Tensor:
            a = layer.self_attn
            group, meta = a.attn.kv_group, groups[a.attn.kv_group][1]
            k.rope_store_layer(desc, i, qkv.data_ptr(), positions.data_ptr(), slots[group].data_ptr(), qkv.shape[0],
                               torch.get_num_threads())
            q, key, value = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
            shape = (qkv.shape[0], -1, a.head_dim)
            attn = a.attn
            return attn.backend.prefill(q.view(shape), key.view(shape), value.view(shape), attn.k_cache,
                                        attn.v_cache, meta, attn.scale, window=attn.sliding_window,
                                        sinks=attn.sinks).flatten(1, -1)
        return self.run_layers(embeds, attend)

    def checked_positions(self, positions: torch.Tensor) -> torch.Tensor:
        positions = positions.to(torch.int64).contiguous()
        if int(positions.max()) >= self.max_position:
            raise ValueError(f"position {int(positions.max())} is past the rotary cache ({self.max_position})")
        return positions

    def run_layer(self, i: int, hidden: torch.Tensor, resid: torch.Tensor, started: bool,
                  attend: Callable[[int, nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Layer i on the stream (hidden, resid; resid = hidden first when not started, updated in
        place): its matmuls (or MLP module) through its own methods, norms and SiLU in C, and
        attend(layer index, layer, qkv [rows, q | k | v]) -> [rows, num_heads * head_dim] between.
        Returns the layer's output."""
        k, desc, threads = self.kernels, ctypes.byref(self.desc), torch.get_num_threads()
        layer = self.modules[i]
        a, mlp = layer.self_attn, layer.mlp
        rows = hidden.shape[0]
        xn = torch.empty_like(hidden)
        k.decode_add_rms_norm(desc, hidden.data_ptr(), resid.data_ptr(), not started,
                              self.layers[i].input_norm, rows, xn.data_ptr(), threads)
        hidden = a.o_proj(attend(i, layer, a.qkv_proj(xn).contiguous()).contiguous()).contiguous()
        k.decode_add_rms_norm(desc, hidden.data_ptr(), resid.data_ptr(), 0,
                              self.layers[i].post_norm, rows, xn.data_ptr(), threads)
        if not isinstance(mlp, GatedMLP):
            return mlp(xn).contiguous()
        gate_up = mlp.gate_up_proj(xn).contiguous()
        act = torch.empty(rows, gate_up.shape[1] // 2)
        k.decode_silu_mul(gate_up.data_ptr(), rows, act.shape[1], act.data_ptr(), threads)
        return mlp.down_proj(act).contiguous()

    def run_layers(self, embeds: torch.Tensor,
                   attend: Callable[[int, nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Every layer through run_layer, then the final norm: the hidden states [rows, hidden]."""
        resid = torch.empty_like(embeds)
        x = embeds
        for i in range(len(self.modules)):
            x = self.run_layer(i, x, resid, i > 0, attend)
        return self.final_normed(x, resid)

    def final_normed(self, hidden: torch.Tensor, resid: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(hidden)
        self.kernels.decode_add_rms_norm(ctypes.byref(self.desc), hidden.data_ptr(), resid.data_ptr(), 0,
                                         self.final_norm_weight, hidden.shape[0], out.data_ptr(),
                                         torch.get_num_threads())
        return out


def build_fused_decode(model: nn.Module, backend_name: str, dtype: torch.dtype, tp_size: int) -> FusedDecode | None:
    """A FusedDecode of model, or None where it does not apply (not a Llama-family decoder, tensor
    parallel, another attention backend, activations not fp32, no C compiler,
    NANOVLLM_CPU_FUSED_DECODE=0); the eager forward then runs every step. The KV cache may be in
    any format (the C attention reads each)."""
    if os.environ.get(DISABLE_ENV, "1").lower() in ("0", "false", "off", "no"):
        return None
    if not isinstance(model, DecoderForCausalLM) or not model.fused_decode or tp_size != 1 \
            or backend_name != "torch" or dtype != torch.float32:
        return None
    kernels = cpu_kernels.load()
    if kernels is None:
        return None
    try:
        return FusedDecode(model, kernels)
    except ValueError as e:
        logger.info("decode steps run the eager forward: %s", e)
        return None
