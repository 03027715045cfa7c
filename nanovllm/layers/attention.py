"""Attention layer: stores this step's K/V into the paged cache, then attends with the backend
picked once by ModelRunner (torch, flash or triton; see layers/backends)."""
import torch
from torch import nn

from nanovllm.distributed.parallel import get_tp_rank, get_tp_size
from nanovllm.layers.backends import AttentionBackend
from nanovllm.layers.backends.kv_formats import KVFormat
from nanovllm.layers.c_description import CDescriber, CPart, NotInC, describes, pointer
from nanovllm.utils.context import get_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logit_softcap: float | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        # Sliding-window attention: a query at position p sees keys at p - window + 1 .. p (None: all).
        self.sliding_window = sliding_window
        # Gemma 2's soft-capping: each scaled score s becomes softcap * tanh(s / softcap) (None: off).
        self.logit_softcap = logit_softcap
        self.sinks: nn.Parameter | None = None  # enable_sinks()
        # Set by ModelRunner: the paged caches of this layer, their storage format and the backend.
        self.k_cache = self.v_cache = torch.tensor([])
        self.kv_format: KVFormat | None = None
        self.backend: AttentionBackend | None = None
        self.kv_group = 0  # whose block tables it reads (engine/kv_groups.py)

    def enable_sinks(self) -> None:
        """Attention sinks (GPT-OSS): a learned logit per head in the softmax's denominator only, a
        parameter `sinks` of this rank's heads (the checkpoint's split like the heads)."""
        self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        self.sinks.weight_loader = self._load_sinks

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != (self.num_heads * get_tp_size(),):
            raise ValueError(f"sinks has shape {tuple(loaded.shape)} for {self.num_heads * get_tp_size()} heads")
        param.data.copy_(loaded.narrow(0, get_tp_rank() * self.num_heads, self.num_heads))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        context = get_context()
        slot_mapping, metadata = context.kv_inputs(self.kv_group)
        if self.k_cache.numel() > 0 and slot_mapping is not None:
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, slot_mapping)
        options = dict(window=self.sliding_window, softcap=self.logit_softcap, sinks=self.sinks)
        if context.is_prefill:
            return self.backend.prefill(q, k, v, self.k_cache, self.v_cache, metadata, self.scale, **options)
        return self.backend.decode(q, self.k_cache, self.v_cache, metadata, self.scale, **options)


@describes(Attention)
def _c_attention(attn: Attention, c: CDescriber) -> CPart:
    """Its caches (in their storage format: the C attention reads each), window, sinks and KV group;
    the model-wide block size, cache type and scale."""
    if attn.logit_softcap is not None:
        raise NotInC("its scores are soft-capped (the C step's softmax has no cap)")
    fields = {"k_cache": pointer(attn.k_cache, attn.kv_format.storage),
              "v_cache": pointer(attn.v_cache, attn.kv_format.storage), "window": attn.sliding_window or 0,
              "sinks": pointer(attn.sinks), "kv_group": attn.kv_group}
    return CPart(fields, model_fields={"block_size": attn.k_cache.shape[1], "kv_type": attn.kv_format.c_type,
                                       "scale": attn.scale})
