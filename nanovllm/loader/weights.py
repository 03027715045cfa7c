"""Checkpoint names onto a model's parameters: each (name, tensor) of a source goes to the
parameter of the same name, or, for a stacked parameter (q/k/v in qkv_proj, an expert's part of
the experts' tensors), to its part through the parameter's weight_loader(param, tensor, shard_id[,
expert_id=]). Missing and unknown weights are errors naming them."""
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.layers.quantization.parameter import copy_checked


@dataclass(frozen=True)
class StackedParam:
    """Checkpoint names containing `.{checkpoint_part}.` (or ending in `.{checkpoint_part}`) load
    into the parameter named with `{param_part}` in its place, as its part shard_id (and expert
    expert_id, for a mixture of experts' stacked tensors: "experts.3.up_proj.weight" ->
    "experts.w13_weight")."""

    param_part: str
    checkpoint_part: str
    shard_id: int | str
    expert_id: int | None = None

    def target(self, name: str) -> str:
        return f"{name}.".replace(f".{self.checkpoint_part}.", f".{self.param_part}.", 1)[:-1]

    def source(self, target: str) -> str:
        """The checkpoint name that target() maps onto target (for messages)."""
        return f"{target}.".replace(f".{self.param_part}.", f".{self.checkpoint_part}.", 1)[:-1]


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    copy_checked(param.data, loaded, "a plain parameter")


class _StackedIndex:
    """The first entry of stacked (in its order) whose checkpoint part is in a name, looked up by
    the name's runs of dot-separated pieces: a mixture of experts has three entries per expert
    (hundreds per model), scanned for each of its thousands of tensors otherwise."""

    def __init__(self, stacked: Sequence[StackedParam]):
        self.order: dict[str, int] = {}
        for i, entry in enumerate(stacked):
            self.order.setdefault(entry.checkpoint_part, i)
        self.stacked = stacked
        self.longest = max((e.checkpoint_part.count(".") + 1 for e in stacked), default=0)

    def entry(self, name: str) -> StackedParam | None:
        pieces = name.split(".")
        found = [self.order[part] for n in range(1, self.longest + 1) for i in range(len(pieces) - n + 1)
                 if (part := ".".join(pieces[i:i + n])) in self.order]
        return self.stacked[min(found)] if found else None


def _listed(names: list[str]) -> str:
    return f"{names[:8]}{' ...' if len(names) > 8 else ''}"


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 stacked: Sequence[StackedParam] = ()) -> None:
    """Copy every weight into model; ValueError on unknown, missing or misshapen ones."""
    params = dict(model.named_parameters())  # tied weights appear once, under their first name
    tied_aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    loaded: set[tuple[str, int | str | None, int | None]] = set()
    unexpected: list[str] = []
    index = _StackedIndex(stacked)
    for name, tensor in weights:
        entry = index.entry(name)
        target = name if entry is None else entry.target(name)
        if target in tied_aliases:
            continue  # e.g. lm_head.weight saved beside tied embeddings
        param = params.get(target)
        if param is None:
            if not name.endswith("rotary_emb.inv_freq"):
                unexpected.append(name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            with torch.no_grad():
                if entry is None:
                    loader(param, tensor)
                elif entry.expert_id is None:
                    loader(param, tensor, entry.shard_id)
                else:
                    loader(param, tensor, entry.shard_id, expert_id=entry.expert_id)
        except ValueError as e:
            raise ValueError(f"cannot load {name!r}: {e}") from e
        loaded.add((target, None, None) if entry is None else (target, entry.shard_id, entry.expert_id))
    if unexpected:
        raise ValueError(f"checkpoint has weights the model does not know: {_listed(unexpected)}")
    missing = [m for n in params for m in _missing(n, loaded, stacked)]
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {_listed(missing)}")


def _missing(name: str, loaded: set, stacked: Sequence[StackedParam]) -> list[str]:
    """[] when parameter name is loaded whole or in every part; else the checkpoint names of what
    it lacks (its own name when it is not stacked)."""
    if (name, None, None) in loaded:
        return []
    parts = [e for e in stacked if f".{e.param_part}." in f"{name}."]
    if not parts:
        return [name]
    return [e.source(name) for e in parts if (name, e.shard_id, e.expert_id) not in loaded]
