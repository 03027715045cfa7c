"""Per-step forward context. ModelRunner sets it before a forward pass; Attention layers read it.
What a backend's kernels need lives in that backend's own metadata (layers/backends)."""
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Context:
    """What every Attention layer of one forward pass reads: whether the step is a prefill, the
    cache slot of each new token (slot_mapping [num_tokens], -1 = do not store; None = no cache),
    and the metadata the picked backend's prepare() built for the step."""

    is_prefill: bool = False
    slot_mapping: torch.Tensor | None = None
    attn_metadata: Any = None  # the backend's own dataclass (TorchMetadata, PagedMetadata, ...)
    # KV groups past the first (engine/kv_groups.py: a model with layers of several attention kinds):
    # each group's (slot_mapping, attn_metadata), over its own block tables.
    more_groups: tuple[tuple[torch.Tensor | None, Any], ...] = ()
    # Linear-attention layers' state slots (layers/gated_deltanet.py, StateBatch); None: no such layer.
    state: Any = None
    # The step's rows by LoRA adapter slot (lora/layers.py LoRABatch); None: no row runs an adapter.
    lora: Any = None

    def drop_stores(self) -> None:
        """Nothing of this forward is stored (the warm-up before the cache exists; embeddings)."""
        self.slot_mapping = None
        self.more_groups = tuple((None, metadata) for _, metadata in self.more_groups)

    def kv_inputs(self, group: int) -> tuple[torch.Tensor | None, Any]:
        """(slot_mapping, attn_metadata) of the layers of KV group `group`."""
        if group == 0:
            return self.slot_mapping, self.attn_metadata
        return self.more_groups[group - 1]


# NOTE: one context per thread: the server steps its engine in a background thread, and another
# engine in the same process (a second LLM, a test's reference) must never see that step's context.
_LOCAL = threading.local()


def get_context() -> Context:
    context = getattr(_LOCAL, "context", None)
    return context if context is not None else Context()


def set_context(context: Context) -> None:
    _LOCAL.context = context


def reset_context() -> None:
    _LOCAL.context = None


@contextmanager
def forward_context(context: Context):
    """Set the context for one forward pass and always clear it afterwards."""
    set_context(context)
    try:
        yield context
    finally:
        reset_context()
