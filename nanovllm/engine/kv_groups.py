"""KV groups: the attention layers that share one block table.

A model whose layers all attend alike (all full, or all over one sliding window) has one group of
every layer, and its cache is what it always was: [2, num_layers, num_blocks, ...]. A model with
layers of several kinds (Gemma 3: five sliding-window layers per full one; GPT-OSS: alternating)
gets one group per `size` layers of a kind, every group `size` layers (the last of a kind may have
fewer), so that a block of any group is the same number of bytes: the cache is
[2, size, num_blocks, ...] and layer j of each group reads slot j. All groups draw their blocks from
the one free list; each sequence holds a block table per group, and a sliding group's blocks that
its window has passed go back to the list while the full groups keep theirs. So a long sequence on
Gemma 3 holds the whole context only for its full layers (vLLM's hybrid KV cache manager does the
same).
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    window: int | None   # the layers' sliding window (None: full attention)
    layers: tuple[int, ...]  # indices into the model's attention layers, in order; layer j reads slot j


def kv_groups(windows: list[int | None], split: bool = True) -> list[KVGroup]:
    """The groups of attention layers with these windows (one entry per layer). split False: one
    group of every layer that keeps every block (window None), for a target whose draft model reads
    the same block table, and for that draft."""
    if not windows:
        raise ValueError("a model without attention layers has no KV cache")
    kinds: dict[int | None, list[int]] = {}
    for i, window in enumerate(windows):
        kinds.setdefault(window, []).append(i)
    if len(kinds) == 1 or not split:
        window = next(iter(kinds)) if split else None
        return [KVGroup(window, tuple(range(len(windows))))]
    # Full-attention groups first: a table of group 0 then always covers the whole sequence.
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    size = min(len(layers) for layers in kinds.values())
    return [KVGroup(window, tuple(kinds[window][i: i + size]))
            for window in order for i in range(0, len(kinds[window]), size)]


def slots_per_block(groups: list[KVGroup]) -> int:
    """Layers a block holds: the largest group's."""
    return max(len(group.layers) for group in groups)
