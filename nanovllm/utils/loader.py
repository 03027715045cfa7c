"""Safetensors loader: maps HF checkpoint names onto our (possibly packed, sharded) parameters
through each parameter's weight_loader. Called once by ModelRunner."""
import glob
import os

import torch
from safetensors import safe_open
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def _target(name: str, packed: dict) -> tuple[str, object]:
    """Our parameter name and shard id for a checkpoint name (shard id None when not packed)."""
    for hf_part, (our_part, shard_id) in packed.items():
        if f".{hf_part}." in name:
            return name.replace(f".{hf_part}.", f".{our_part}."), shard_id
    return name, None


def load_model(model: nn.Module, path: str) -> None:
    """Copy every tensor of path/*.safetensors into model; error on missing or unknown weights."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}")
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())  # tied weights appear once, under their first name
    tied_aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    loaded_names: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                target, shard_id = _target(name, packed)
                if target in tied_aliases:
                    continue  # e.g. lm_head.weight saved beside tied embeddings
                param = params.get(target)
                if param is None:
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    unexpected.append(name)
                    continue
                loader = getattr(param, "weight_loader", default_weight_loader)
                tensor = f.get_tensor(name)
                try:
                    with torch.no_grad():
                        loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)
                except ValueError as e:
                    raise ValueError(f"cannot load {name!r} from {os.path.basename(file)}: {e}") from e
                loaded_names.add(target if shard_id is None else f"{target}:{shard_id}")
    if unexpected:
        raise ValueError(f"checkpoint has weights the model does not know: {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}")
    missing = [n for n in params if not _is_loaded(n, loaded_names, packed)]
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def _is_loaded(name: str, loaded: set[str], packed: dict) -> bool:
    if name in loaded:
        return True
    shard_ids = [sid for hf_part, (our_part, sid) in packed.items() if f".{our_part}." in name]
    return bool(shard_ids) and all(f"{name}:{sid}" in loaded for sid in shard_ids)
