"""Per-step attention metadata. ModelRunner sets it before a forward pass; Attention layers read it."""
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class Context:
    """What the attention layers of one forward pass need to know about the batch.

    Prefill: cu_seqlens_q / cu_seqlens_k are [num_seqs + 1] offsets of each sequence's new tokens
    and of its whole key range (cached prefix + new tokens). Decode: context_lens is [num_seqs].
    block_tables is [num_seqs, max_blocks] (padded with -1); slot_mapping is [num_tokens], -1 = skip.
    """

    is_prefill: bool = False
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    has_cached_prefix: bool = False
    # Host copies for backends that loop over sequences on the CPU.
    seqlens_q_host: list[int] | None = None
    seqlens_k_host: list[int] | None = None
    # Per-step memo a backend may fill on the first layer and reuse in the others.
    backend_cache: dict = field(default_factory=dict)


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
