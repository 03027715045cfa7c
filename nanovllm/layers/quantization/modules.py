"""How a model's layers map onto checkpoint modules, for the configs that choose a method per
layer from the checkpoint's own names: the parts stacked in a layer (q/k/v, gate/up), and which
modules tensor parallelism splits along their inputs."""
from torch import nn

# The modules whose inputs tensor parallelism splits (row-parallel), by their checkpoint names: the
# attention's output, the MLP's, a shared expert's and the experts' down projections.
ROW_PARALLEL = ("self_attn.o_proj", "down_proj")


def checkpoint_modules(layer: nn.Module, prefix: str, packed_modules_mapping: dict) -> list[str]:
    """The checkpoint module names stacked in the layer at prefix (itself when not stacked), in part order."""
    if not hasattr(layer, "shard_index"):
        return [prefix]
    base, _, last = prefix.rpartition(".")
    parts = [(layer.shard_index(shard), f"{base}.{ckpt}")
             for ckpt, (param, shard) in packed_modules_mapping.items() if param == last]
    return [name for _, name in sorted(parts)] or [prefix]
