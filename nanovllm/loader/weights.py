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
    """Checkpoint names containing `.{checkpoint_part}.` load into `.{param_part}.`'s part
    shard_id (and expert expert_id, for a mixture of experts' stacked tensors)."""

    param_part: str
    checkpoint_part: str
    shard_id: int | str
    expert_id: int | None = None


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    copy_checked(param.data, loaded, "a plain parameter")


def _stacked_entry(name: str, stacked: Sequence[StackedParam]) -> StackedParam | None:
    for entry in stacked:
        if f".{entry.checkpoint_part}." in name:
            return entry
    return None


def _listed(names: list[str]) -> str:
    return f"{names[:8]}{' ...' if len(names) > 8 else ''}"


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 stacked: Sequence[StackedParam] = ()) -> None:
    """Copy every weight into model; ValueError on unknown, missing or misshapen ones."""
    params = dict(model.named_parameters())  # tied weights appear once, under their first name
    tied_aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    loaded: set[tuple[str, int | str | None, int | None]] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        entry = _stacked_entry(name, stacked)
        target = name if entry is None else name.replace(f".{entry.checkpoint_part}.", f".{entry.param_part}.")
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
    missing = [n for n in params if not _is_loaded(n, loaded, stacked)]
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {_listed(missing)}")


def _is_loaded(name: str, loaded: set, stacked: Sequence[StackedParam]) -> bool:
    if (name, None, None) in loaded:
        return True
    parts = {(e.shard_id, e.expert_id) for e in stacked if f".{e.param_part}." in name}
    return bool(parts) and all((name, sid, eid) in loaded for sid, eid in parts)
