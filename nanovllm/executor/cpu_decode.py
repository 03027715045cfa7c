"""FusedDecode: CPU decode steps of a decoder-only model in C (kernels/cpu_decode.c), the CPU's
counterpart of CUDA graphs: the eager forward dispatches ~140 torch ops per layer, which cost more
than reading the weights at a few sequences and a good share of the step at more (docs/performance.md,
"The C decode step").

Built once after the KV cache exists by walking the model: every part describes itself to C where
its class is defined (layers/c_description.py: the layers, norms, attention, MLP and MoE blocks,
linear attention), so this walker knows no model class. It lays the answers out, by field name, in
the ctypes structures (kernels/cpu_structs.py) that the C side reads every step. Decode steps of
any batch (of cpu_kernels.MAX_ROWS where some layer's weights are read by torch) run each range of
layers whose weights all have views as one C call; a layer without them runs its own modules
between the C phases. Larger decode steps and prefill steps run every layer that way: the matmuls
on the layers' own methods, norms, rotary + KV store, attention (decode) and SiLU in C.

Layers that describe themselves as one-call-only (the hybrids' gated attention and Gated DeltaNet:
no phases of their own between torch's matmuls) run their decode steps in the one call only, so a
hybrid's prefill steps and batches past the one call's rows run eager. Where a part cannot be run,
build_fused_decode says which and why (a WARNING of the start-up summary).
"""
import ctypes
import logging
import os
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.executor.step_runner import StepRunner
from nanovllm.kernels import cpu_kernels
from nanovllm.kernels.cpu_structs import DecoderLayer, DecoderModel, DecodeStep, Linear, LoraMatrix, LoraStep, MoeExperts
from nanovllm.layers.c_description import CDescriber, CModel, CPart, NotInC, Phases, by_field, describe
from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.utils.context import Context

DISABLE_ENV = "NANOVLLM_CPU_FUSED_DECODE"

logger = logging.getLogger(__name__)

# The fields a layer not run whole in C leaves empty (its matmuls run on its own modules).
MATMUL_FIELDS = {"qkv": Linear(), "o": Linear(), "gate_up": Linear(), "down": Linear(), "moe": None}


def segments(in_c: list[bool]) -> list[tuple[int, int, bool]]:
    """Maximal runs (first, end, in_c) of consecutive layers alike."""
    runs: list[tuple[int, int, bool]] = []
    for i, flag in enumerate(in_c):
        if runs and runs[-1][2] == flag:
            runs[-1] = (runs[-1][0], i + 1, flag)
        else:
            runs.append((i, i + 1, flag))
    return runs


class FusedDecode(StepRunner):
    """The decode forward (the embedding lookup, every layer, the final norm and, in the one-call
    path, the LM head) and the prefill layers, in C where it can."""

    max_rows = cpu_kernels.MAX_ROWS
    runs_lora = True  # the one call adds adapters itself (lora_step); the matmuls torch runs, their modules

    def __init__(self, model: nn.Module, kernels: cpu_kernels.CpuKernels):
        self.kernels = kernels
        # NOTE: the modules keep alive every tensor whose address the structures hold, and self.c
        # the structures and tensors made for them.
        self.c = c = CDescriber(kernels)
        parts: CModel = describe(model, c, "the model")
        self.modules = layers = parts.layers
        self.final_norm = parts.norm
        self.final_norm_weight = c.norm(parts.norm, "the final norm")
        self.embed_module, self.head_module = parts.embed, parts.head
        self.embed_scale, self.logit_scale = parts.embed_scale, parts.logit_scale
        self.compute_logits = model.compute_logits
        described: list[CPart] = [describe(layer, c, f"layer {i}") for i, layer in enumerate(layers)]
        attention = [(i, part) for i, part in enumerate(described) if part.model_fields]
        if not attention:
            raise NotInC("the model has no attention layer")
        first, settings = attention[0][0], attention[0][1].model_fields
        for i, part in attention[1:]:
            differs = sorted(k for k in settings if part.model_fields.get(k) != settings[k])
            if differs:
                raise NotInC(f"layer {i}'s attention differs from layer {first}'s in {differs} (the C step takes one "
                             "setting for all)")
        self.hybrid = any(part.one_call_only for part in described)
        in_c = [part.in_c for part in described]
        if self.hybrid and not all(in_c):
            raise NotInC(f"layer {in_c.index(False)} is not whole in C (a matrix without a C view, or a block of "
                         "its own), and this model's layers run in the one call only")
        if len(c.eps) != 1:
            raise NotInC(f"the C step takes one RMSNorm eps, the model has {sorted(c.eps)}")
        self.phases: list[Phases] = [part.phases for part in described]
        self.layers = (DecoderLayer * len(described))(*(
            by_field(DecoderLayer, {**part.fields, "in_c": int(part.in_c), **({} if part.in_c else MATMUL_FIELDS)})
            for part in described))
        self.moes: list[MoeExperts] = [layer.moe.contents for layer in self.layers if layer.moe]
        self.max_position = described[first].max_position
        self.segments = segments(in_c)
        embed, head = c.linear(self.embed_module, "the embedding"), c.linear(self.head_module, "the head")
        self.linears: list[Linear] = [x for x in c.kept if isinstance(x, Linear)]
        self.embed_in_c, self.head_in_c = embed is not None, head is not None
        intermediate = max([d.down.k for d in self.layers if d.in_c] + [moe.shared_down.k for moe in self.moes],
                           default=0)
        self.desc = by_field(DecoderModel, dict(
            num_layers=len(described), hidden=parts.norm.weight.numel(), intermediate=intermediate, eps=c.eps.pop(),
            final_norm=self.final_norm_weight, layers=self.layers, embed=embed or Linear(), head=head or Linear(),
            embed_scale=parts.embed_scale, residual_scale=parts.residual_scale, logit_scale=parts.logit_scale,
            **settings))
        bad = kernels.decode_check_model(ctypes.byref(self.desc))
        if bad >= 0:
            raise NotInC(f"the C description of {'layer %d' % bad if bad < len(described) else 'the embedding or head'}"
                         " is not valid")
        self.one_call_layers = sum(in_c)
        # Every matmul on the C kernels alone (block formats, dense fp32 / bf16: no torch path to
        # hand larger batches to): the step is one C call at every batch size, not only up to MAX_ROWS.
        # (A MoE router or shared-expert gate is a dense [E, H] / [1, H] matrix: too small to matter.)
        methods = [m.quant_method for layer in layers for m in layer.modules()
                   if hasattr(m, "quant_method") and not isinstance(m, ReplicatedLinear)]
        methods += [self.embed_module.quant_method, self.head_module.quant_method]
        if all(in_c) and self.head_in_c and all(method.c_only for method in methods):
            self.max_rows = cpu_kernels.ALL_ROWS
        self.lora_seen = -1  # LoRALayer.allocations when the adapters' C description was last made
        self.lora_mats = self.lora_width = None  # that description (None: some adapter matrix has none)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ids as the model scales them (outside the one call)."""
        rows = self.embed_module(ids)
        return rows if self.embed_scale == 1.0 else rows * self.embed_scale

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of the final-normed hidden rows as the model scales them (outside the one call)."""
        logits = self.head_module(hidden)
        return logits if self.logit_scale == 1.0 else logits * self.logit_scale

    def lora_matrices(self):
        """The adapter slots of each layer's qkv, o, gate_up and down as the one call reads them
        (cpu_structs.LoraMatrix [layers x 4]), None where an adapter touches a matrix it does not
        run: a gated, linear-attention or MoE layer run in C (layers run by their modules add their
        adapters themselves). Redescribed when a layer allocates its slots."""
        from nanovllm.lora.layers import LoRALayer
        if self.lora_seen == LoRALayer.allocations:
            return self.lora_mats
        self.lora_seen = LoRALayer.allocations
        self.lora_mats, self.lora_width = None, 0
        mats = (LoraMatrix * (4 * len(self.modules)))()
        for i, (layer, phases, desc) in enumerate(zip(self.modules, self.phases, self.layers)):
            if not desc.in_c:
                continue
            plain = not (desc.attn_gate or desc.linear or desc.short_conv or desc.mamba2 or desc.moe)
            seats = [phases.qkv, phases.o, phases.gate_up, phases.down] if plain else []
            for j, module in enumerate(seats):
                if module is None or module.lora is None or not module.lora.allocated:
                    continue
                matrix = module.lora.c_matrix()
                if matrix is None:
                    return None  # slots the C step cannot read (float16)
                mats[4 * i + j] = matrix
                self.lora_width = max(self.lora_width, matrix.parts * matrix.rank)
            placed = {id(module) for module in seats}
            for module in layer.modules():
                lora = getattr(module, "lora", None)
                if lora is not None and lora.allocated and id(module) not in placed:
                    return None  # an adapter on a matrix the one call runs without it
        for matrix in mats:
            if matrix.a and not self.kernels.lora_matrix_is_valid(ctypes.byref(matrix)):
                raise ValueError("an adapter's C description is not valid")
        self.lora_mats = mats
        return mats

    def can_run(self, num_tokens: int, context: Context) -> bool:
        if (context.lora is not None and not context.is_prefill and num_tokens <= self.max_rows
                and self.lora_matrices() is None):
            return False  # the one call would miss an adapter's matrix
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
                                    num_seqs, tables.shape[1], meta.max_seqlen_k, int(meta.rows_share_tables),
                                    None if state_slots is None else state_slots.data_ptr()))
        steps = (DecodeStep * len(steps))(*steps)
        k, desc, step_ref = self.kernels, ctypes.byref(self.desc), ctypes.byref(steps)

        def attend(i: int, phases: Phases, qkv: torch.Tensor) -> torch.Tensor:
            attn = torch.empty(qkv.shape[0], phases.q_size)
            if k.decode_attention_layer(desc, i, qkv.data_ptr(), step_ref, attn.data_ptr(), torch.get_num_threads()):
                raise MemoryError("the fused CPU decode step could not allocate its buffers")
            return attn
        if num_seqs <= self.max_rows:
            return self.run_one_call(input_ids, step_ref, attend, self.lora_step(context))
        return self.lm_head(self.run_layers(self.embed(input_ids).contiguous(), attend))

    def lora_step(self, context: Context) -> LoraStep | None:
        """The step's adapters for the one call (None: no row has one). NOTE: points into
        context.lora's row slots, which live until the step returns."""
        if context.lora is None:
            return None
        mats = self.lora_matrices()
        return LoraStep(mats, context.lora.row_slots.data_ptr(), self.lora_width)

    def run_one_call(self, input_ids: torch.Tensor, step_ref,
                     attend: Callable[[int, Phases, torch.Tensor], torch.Tensor],
                     lora: LoraStep | None = None) -> torch.Tensor:
        """Each run of C-described layers one C call (the embedding and LM head inside where they
        have views), the other layers through run_layer. lora: the step's adapters (lora_step)."""
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
                None if logits is None else logits.data_ptr(), None if lora is None else ctypes.byref(lora),
                torch.get_num_threads())
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

        def attend(i: int, phases: Phases, qkv: torch.Tensor) -> torch.Tensor:
            attn = phases.attention
            group, meta = attn.kv_group, groups[attn.kv_group][1]
            k.rope_store_layer(desc, i, qkv.data_ptr(), positions.data_ptr(), slots[group].data_ptr(), qkv.shape[0],
                               torch.get_num_threads())
            q, key, value = qkv.split([phases.q_size, phases.kv_size, phases.kv_size], dim=-1)
            shape = (qkv.shape[0], -1, phases.head_dim)
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
                  attend: Callable[[int, Phases, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Layer i on the stream (hidden, resid; resid = hidden first when not started, updated in
        place): its matmuls (or MLP module) through its own methods, norms and SiLU in C, and
        attend(layer index, its phases, qkv [rows, q | k | v]) -> [rows, num_heads * head_dim] between.
        Returns the layer's output."""
        k, desc, threads = self.kernels, ctypes.byref(self.desc), torch.get_num_threads()
        phases = self.phases[i]
        rows = hidden.shape[0]
        xn = torch.empty_like(hidden)
        k.decode_add_rms_norm(desc, hidden.data_ptr(), resid.data_ptr(), not started,
                              self.layers[i].input_norm, rows, xn.data_ptr(), threads)
        hidden = phases.o(attend(i, phases, phases.qkv(xn).contiguous()).contiguous()).contiguous()
        k.decode_add_rms_norm(desc, hidden.data_ptr(), resid.data_ptr(), 0,
                              self.layers[i].post_norm, rows, xn.data_ptr(), threads)
        if phases.gate_up is None:  # a block run whole (a sparse MoE block)
            return phases.mlp(xn).contiguous()
        gate_up = phases.gate_up(xn).contiguous()
        act = torch.empty(rows, gate_up.shape[1] // 2)
        k.decode_silu_mul(gate_up.data_ptr(), rows, act.shape[1], act.data_ptr(), threads)
        return phases.down(act).contiguous()

    def run_layers(self, embeds: torch.Tensor,
                   attend: Callable[[int, Phases, torch.Tensor], torch.Tensor]) -> torch.Tensor:
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


def build_fused_decode(model: nn.Module, backend_name: str, dtype: torch.dtype,
                       tp_size: int) -> tuple[FusedDecode | None, str | None]:
    """(a FusedDecode of model, None) where it applies; else (None, why not) where a user would want
    to know (a part of the model that cannot run in C: the start-up summary's WARNING), (None, None)
    where the setting rules it out (tensor parallel, another attention backend, activations not fp32,
    NANOVLLM_CPU_FUSED_DECODE=0) or the C kernels are not built (cpu_kernels.load says why). The eager forward then runs every
    step. The KV cache may be in any format (the C attention reads each)."""
    if os.environ.get(DISABLE_ENV, "1").lower() in ("0", "false", "off", "no"):
        return None, None
    if tp_size != 1 or backend_name != "torch" or dtype != torch.float32:
        return None, None
    kernels = cpu_kernels.load()
    if kernels is None:  # load() has said why
        return None, None
    try:
        return FusedDecode(model, kernels), None
    except ValueError as e:  # NotInC, and a structure the C side finds not valid
        return None, f"decode steps run the eager forward, not the C step: {e}"
