"""The model side of LoRA: every linear layer's adapter slots, filled from host adapters (an LRU of
max_cpu_loras), and the step's rows grouped by slot (LoRABatch, in the forward context). A layer's
base projection runs once for the whole batch; then each slot's rows get x A^T B^T added
(LoRALayer.add: Punica's SGMV shape, one shrink and one expand per slot with rows in the step).

Tensor parallelism: an adapter is split as its layer is. Column-parallel layers (outputs split) take
their rank's rows of B; row-parallel ones (inputs split) their rank's columns of A, and the partial
products are summed by the layer's own all-reduce."""
import ctypes
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from nanovllm.kernels.cpu_structs import LORA_DTYPES, LORA_MAX_PARTS, LoraMatrix
from nanovllm.layers.linear import LinearBase
from nanovllm.layers.moe import FusedMoE
from nanovllm.layers.quantization.unquantized import UnquantizedLinearMethod
from nanovllm.lora.adapter import EXPERT_PARTS, LoRAAdapter, LoRATarget, load_adapter
from nanovllm.lora.experts import ExpertsLoRA, has_dense_experts
from nanovllm.lora.request import LoRARequest
from nanovllm.utils.context import get_context


@dataclass
class LoRABatch:
    """One step's rows by slot: (slot, rows) for each slot with rows in the step, rows a slice where
    they are contiguous (a prefill's sequence, one decode row) and an index tensor otherwise."""

    groups: list[tuple[int, slice | torch.Tensor]]
    row_slots: torch.Tensor  # [rows] int64 on the host: each row's slot, -1 for the base model (the C step's)
    device_row_slots: torch.Tensor  # the same on the model's device (the Triton kernels')
    # Outside the C decode step, the CPU's C kernel (lora_apply) adds the updates of slots with fewer
    # than C_GROUP_ROWS rows in the step: c_row_slots is row_slots with the other rows at -1 (None:
    # no such slot), and torch_groups those other groups, whose rows torch's products take.
    c_row_slots: torch.Tensor | None = None
    torch_groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)


# The rows of one slot from which torch's products (a few ops per slot and layer, then BLAS) beat the
# C kernel's per-row dots: one slot's rows on the default model's and Qwen3-0.6B's projections (int8
# slots, 2 threads), C / torch: 1.3-3x faster at 128 rows, level at 256, down to 0.86x at 512.
C_GROUP_ROWS = 256


def lora_targets(model: torch.nn.Module) -> dict[str, tuple[LinearBase, LoRATarget]]:
    """Each projection an adapter may update, by its checkpoint name: (its layer, its target). A stacked
    layer (qkv_proj, gate_up_proj) holds several, named through the model's packed_modules_mapping."""
    packed: dict[str, list[tuple[str, object]]] = {}
    for part, (param_part, shard_id) in getattr(model, "packed_modules_mapping", {}).items():
        packed.setdefault(param_part, []).append((part, shard_id))
    targets = {}
    for prefix, layer in model.named_modules():
        if isinstance(layer, FusedMoE):  # PEFT's target_parameters on the stacked experts
            hidden, inter = layer.hidden_size, layer.intermediate_size * layer.tp_size
            for index, (part, size_in, size_out) in enumerate(((EXPERT_PARTS[0], hidden, 2 * inter), (EXPERT_PARTS[1], inter, hidden))):
                targets[f"{prefix}.{part}"] = (layer, LoRATarget(prefix, index, size_in, size_out, layer.num_experts,
                                                                 has_dense_experts(layer)))
            continue
        if not isinstance(layer, LinearBase):
            continue
        parent, _, leaf = prefix.rpartition(".")
        in_size = layer.input_size * (layer.tp_size if layer.tp_dim == 1 else 1)
        outs = [size * (layer.tp_size if layer.tp_dim == 0 else 1) for size in layer.output_partition_sizes]
        names = [(f"{parent}.{part}", layer.shard_index(shard_id)) for part, shard_id in packed.get(leaf, [])]
        for name, index in names or [(prefix, 0)]:
            targets[name] = (layer, LoRATarget(prefix, index, in_size, outs[index]))
    return targets


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, n] as int8 [rows, n] times a scale per row (symmetric, the row's largest magnitude to
    127): int8 slots, lora_dtype."""
    w = w.float()
    scale = w.abs().amax(dim=1) / 127
    return torch.round(w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).to(torch.int8), scale


def slot_dtype(lora_dtype: torch.dtype | None, model: torch.nn.Module, model_dtype: torch.dtype,
               triton: bool) -> torch.dtype:
    """The slots' dtype for EngineArgs.lora_dtype (None: "auto"): auto is int8 where the base layers are
    quantized and the CPU's kernels run the updates (the base layer's precision, a quarter of fp32's
    bytes), else the model's dtype. int8 with the Triton kernels is refused."""
    if lora_dtype == torch.int8 and triton:
        raise ValueError("lora_dtype 'int8' is read by the CPU's kernels only; on this device use 'auto', "
                         "'bfloat16' or 'float16'")
    if lora_dtype is not None:
        return lora_dtype
    quantized = any(not isinstance(layer.quant_method, UnquantizedLinearMethod)
                    for _, (layer, target) in lora_targets(model).items() if not target.experts)
    return torch.int8 if quantized and not triton else model_dtype


class LoRALayer:
    """A linear layer's adapter slots: A [slots, parts x rank, in] and B^T [slots, rank, out] (this
    rank's shares; B transposed so that the expand runs along the outputs), allocated when a first
    adapter touches the layer. Lower ranks are zero-padded."""

    # How many layers (LoRALayer or ExpertsLoRA) have allocated their slots, process-wide: the C step
    # redescribes the slots when it changes (LoRAModel.activate counts).
    allocations = 0

    def __init__(self, layer: LinearBase, max_loras: int, max_rank: int):
        self.layer = layer
        self.max_loras, self.rank = max_loras, max_rank
        offsets = [sum(layer.output_partition_sizes[:i]) for i in range(len(layer.output_partition_sizes))]
        self.parts = list(zip(offsets, layer.output_partition_sizes))
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None
        self.a_scale = self.b_scale = None  # int8 slots: A's and B^T's scale per row (per part for B^T)
        self.filled = [[False] * len(self.parts) for _ in range(max_loras)]  # slot -> part -> has weights
        self.triton = False  # the update by kernels/triton_lora.py (a GPU; the interpreter in tests)
        self.c_kernels = None  # the CPU's C kernels (fp32 activations: cpu_lora.c's lora_apply)
        self.c_desc: LoraMatrix | None = None  # c_matrix(), made on the first update through them
        self.column_parts: torch.Tensor | None = None

    def _allocate(self, dtype: torch.dtype, device: torch.device) -> None:
        layer, parts, r = self.layer, len(self.parts), self.rank
        out = sum(size for _, size in self.parts)
        self.a = torch.zeros(self.max_loras, parts * r, layer.input_size, dtype=dtype, device=device)
        self.b = torch.zeros(self.max_loras, r, out, dtype=dtype, device=device)
        if dtype == torch.int8:
            self.a_scale = torch.zeros(self.max_loras, parts * r, dtype=torch.float32, device=device)
            self.b_scale = torch.zeros(self.max_loras, r, parts, dtype=torch.float32, device=device)

    def c_matrix(self) -> LoraMatrix | None:
        """The slots as the C decode step reads them (kernels/cpu_lora.c), None where it cannot (more
        than LORA_MAX_PARTS parts, float16). Only once allocated. NOTE: points into a and b (and their
        scales), which live as long as the layer."""
        dtype = str(self.a.dtype).removeprefix("torch.")
        if len(self.parts) > LORA_MAX_PARTS or dtype not in LORA_DTYPES:
            return None
        ends = [offset + size for offset, size in self.parts]
        scales = (self.a_scale.data_ptr(), self.b_scale.data_ptr()) if self.a_scale is not None else (None, None)
        return LoraMatrix(a=self.a.data_ptr(), b=self.b.data_ptr(), k=self.a.shape[2], n=self.b.shape[2],
                          rank=self.rank, parts=len(self.parts), slots=self.max_loras,
                          part_ends=(ctypes.c_int64 * LORA_MAX_PARTS)(*ends), dtype=LORA_DTYPES[dtype],
                          a_scale=scales[0], b_scale=scales[1])

    @property
    def allocated(self) -> bool:
        return self.a is not None

    def clear(self, slot: int) -> None:
        if self.a is not None and any(self.filled[slot]):
            self.a[slot].zero_()
            self.b[slot].zero_()
        self.filled[slot] = [False] * len(self.parts)

    def fill(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype,
             device: torch.device) -> None:
        """Slot's part from the full A [r, in] and B [out, r], split as the layer is."""
        layer, r = self.layer, a.shape[0]
        if self.a is None:
            self._allocate(dtype, device)
        if layer.tp_size > 1 and layer.tp_dim == 1:
            a = a.chunk(layer.tp_size, dim=1)[layer.tp_rank]
        if layer.tp_size > 1 and layer.tp_dim == 0:
            b = b.chunk(layer.tp_size, dim=0)[layer.tp_rank]
        offset, size = self.parts[part]
        rows, bt = slice(part * self.rank, part * self.rank + r), b.t()
        if self.a_scale is not None:
            a, self.a_scale[slot, rows] = quantize_rows(a)
            bt, self.b_scale[slot, :r, part] = quantize_rows(bt)
        self.a[slot, rows].copy_(a)
        self.b[slot, :r, offset: offset + size].copy_(bt)
        self.filled[slot][part] = True

    def slot_a(self, slot: int, dtype: torch.dtype) -> torch.Tensor:
        """Slot's A [parts x rank, in] in dtype."""
        if self.a_scale is None:
            return self.a[slot].to(dtype)
        return (self.a[slot].float() * self.a_scale[slot, :, None]).to(dtype)

    def slot_bt(self, slot: int, part: int, dtype: torch.dtype) -> torch.Tensor:
        """Slot's part of B^T [rank, its outputs] in dtype."""
        offset, size = self.parts[part]
        bt = self.b[slot, :, offset: offset + size]
        if self.b_scale is None:
            return bt.to(dtype)
        return (bt.float() * self.b_scale[slot, :, part, None]).to(dtype)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base projection of x) plus each row's update from its slot."""
        batch = get_context().lora
        if batch is None or self.a is None:
            return y
        if self.triton:
            from nanovllm.kernels import triton_lora
            if self.column_parts is None:
                self.column_parts = triton_lora.column_parts([size for _, size in self.parts], y.device)
            return triton_lora.lora_add(x, y.contiguous(), self.a, self.b, batch.device_row_slots, self.column_parts)
        groups = batch.groups
        if (self.c_kernels is not None and batch.c_row_slots is not None and x.dtype == y.dtype == torch.float32
                and self.apply_c(x, y, batch.c_row_slots)):
            groups = batch.torch_groups
        r = self.rank
        for slot, rows in groups:
            filled = self.filled[slot]
            if not any(filled):
                continue
            # (slots held in another dtype than the activations, lora_dtype: widened per step)
            t = x[rows] @ self.slot_a(slot, x.dtype).t()  # the shrink: [rows, parts x rank]
            for p, (offset, size) in enumerate(self.parts):
                if not filled[p]:
                    continue
                d = t[:, p * r:(p + 1) * r] @ self.slot_bt(slot, p, x.dtype)  # the expand
                if isinstance(rows, slice):
                    y[rows, offset: offset + size] += d
                else:
                    y[:, offset: offset + size].index_add_(0, rows, d)
        return y

    def apply_c(self, x: torch.Tensor, y: torch.Tensor, row_slots: torch.Tensor) -> bool:
        """y += the update of each row with a slot in row_slots, by the C kernel (one call for all
        slots: per row and rank row a dot with A, then B^T streamed per row); False where it cannot
        (the slots' dtype, a strided y)."""
        if self.c_desc is None:
            self.c_desc = self.c_matrix()
            if self.c_desc is None:
                self.c_kernels = None
                return False
        if x.stride(-1) != 1 or y.stride(-1) != 1 or x.dim() != 2 or y.dim() != 2:
            return False
        rows = x.shape[0]
        scratch = torch.empty(rows * self.a.shape[1], dtype=torch.float32)
        if self.c_kernels.lora_apply(ctypes.byref(self.c_desc), x.data_ptr(), x.stride(0), rows,
                                     row_slots.data_ptr(), scratch.data_ptr(), y.data_ptr(), y.stride(0),
                                     torch.get_num_threads()):
            raise RuntimeError(f"the C kernels refused the LoRA slots of {self.layer.__class__.__name__}")
        return True


class LoRAModel:
    """The adapters of one rank's model: which request each slot holds, the layers' slots, and the host
    copies of recently used adapters (at most max_cpu_loras, least recently used dropped first)."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device, to_device, hf_config=None):
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.hf_config = hf_config  # the base model's (a GGUF adapter names its architecture and head order)
        self.dtype, self.device, self.to_device = dtype, device, to_device
        found = lora_targets(model)
        self.targets = {name: target for name, (_, target) in found.items()}
        self.layers: dict[str, LoRALayer | ExpertsLoRA] = {}
        for _, (layer, target) in found.items():
            if target.module not in self.layers:
                kind = ExpertsLoRA if target.experts else LoRALayer
                layer.lora = self.layers[target.module] = kind(layer, max_loras, max_rank)
        self.slots: list[LoRARequest | None] = [None] * max_loras
        self.adapters: OrderedDict[LoRARequest, LoRAAdapter] = OrderedDict()
        # NOTE: the server reads adapters on its preparation thread while the engine thread steps.
        self._lock = threading.Lock()

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The request's adapter, read (and checked) on first use, then kept among the recent ones."""
        with self._lock:
            adapter = self.adapters.get(request)
        if adapter is None:
            adapter = load_adapter(request, self.targets, self.max_rank, self.hf_config)  # outside the lock: file reads
        with self._lock:
            self.adapters[request] = adapter
            self.adapters.move_to_end(request)
            while len(self.adapters) > self.max_cpu_loras:
                self.adapters.popitem(last=False)
        return adapter

    def use_kernels(self, triton: bool = False, c_kernels=None) -> None:
        """Which kernels run the layers' updates outside the C decode step: the Triton ones
        (kernels/triton_lora.py), the CPU's C ones (c_kernels, for fp32 activations: cpu_lora.c's
        lora_apply), else torch's products per slot."""
        for layer in self.layers.values():
            layer.triton, layer.c_kernels = triton, c_kernels

    def graph_ready(self) -> bool:
        """Whether CUDA graphs can hold the updates: every layer's by the Triton kernels, which read
        the rows' slots from a tensor (the experts' grouped loop reads them on the host)."""
        return all(isinstance(layer, LoRALayer) and layer.triton for layer in self.layers.values())

    def allocate_all(self) -> None:
        """Every layer's slots now (graphs capture the slots' addresses before any adapter is read)."""
        for layer in self.layers.values():
            if not layer.allocated:
                layer._allocate(self.dtype, self.device)
                LoRALayer.allocations += 1

    def graph_batch(self, row_slots: torch.Tensor) -> LoRABatch:
        """A captured graph's LoRABatch: row_slots the graph's static buffer of each row's slot (no
        host-side groups: only the Triton kernels, which read the buffer, run in a graph)."""
        return LoRABatch([], row_slots, row_slots)

    def forget(self, request: LoRARequest) -> None:
        with self._lock:
            self.adapters.pop(request, None)

    def activate(self, slots: tuple[LoRARequest | None, ...]) -> None:
        """Make each slot hold the scheduler's adapter for it (only slots that changed are written)."""
        for slot, request in enumerate(slots):
            if request == self.slots[slot]:
                continue
            for layer in self.layers.values():
                layer.clear(slot)
            self.slots[slot] = None
            if request is not None:
                for name, (a, b) in self.adapter(request).weights.items():
                    target = self.targets[name]
                    layer = self.layers[target.module]
                    allocated = layer.allocated
                    layer.fill(slot, target.part, a, b, self.dtype, self.device)
                    if not allocated:
                        LoRALayer.allocations += 1  # a layer's first slots (the C step redescribes them)
                self.slots[slot] = request

    def batch(self, row_slots: list[int], row_tokens: list[int]) -> LoRABatch | None:
        """The step's LoRABatch: row i's row_tokens[i] tokens run with slot row_slots[i] (-1: none);
        None when no row has an adapter."""
        if all(s < 0 for s in row_slots):
            return None
        by_slot: dict[int, list[int]] = {}
        start = 0
        for slot, n in zip(row_slots, row_tokens):
            if slot >= 0:
                by_slot.setdefault(slot, []).extend(range(start, start + n))
            start += n
        row_slots = torch.tensor([slot for slot, n in zip(row_slots, row_tokens) for _ in range(n)], dtype=torch.int64)
        groups = []
        for slot, rows in by_slot.items():
            if rows[-1] - rows[0] + 1 == len(rows):
                groups.append((slot, slice(rows[0], rows[-1] + 1)))
            else:
                groups.append((slot, self.to_device(torch.tensor(rows, dtype=torch.int64))))
        few = [slot for slot, rows in by_slot.items() if len(rows) < C_GROUP_ROWS]
        c_row_slots = None
        if len(few) == len(by_slot):  # (the usual case: every slot's rows to the C kernel)
            c_row_slots = row_slots
        elif few:
            c_row_slots = torch.where(torch.isin(row_slots, torch.tensor(few)), row_slots, -1)
        return LoRABatch(groups, row_slots, self.to_device(row_slots), c_row_slots,
                         [group for group in groups if group[0] not in few])
