"""SmolLM3: Llama's blocks with every `no_rope_layer_interval`-th layer (4: layers 3, 7, ...) a NoPE
layer, its q and k unrotated (config.no_rope_layers: 1 rotates, 0 does not), and optionally a
sliding window on those layers (use_sliding_window: transformers puts them in `layer_types`)."""
from nanovllm.layers.c_description import CDescriber, CPart, describes
from nanovllm.models.decoder import DecoderForCausalLM, DecoderLayer, DecoderModel, pre_norm_layer_part


def rope_layers(config) -> list[bool]:
    """Whether each layer rotates q and k: config.no_rope_layers, else every interval-th layer not
    (transformers' default; llama.cpp's smollm3 files state neither and use an interval of 4)."""
    flags = getattr(config, "no_rope_layers", None)
    if flags is None:
        interval = getattr(config, "no_rope_layer_interval", None) or 4
        flags = [int((i + 1) % interval != 0) for i in range(config.num_hidden_layers)]
    if len(flags) < config.num_hidden_layers or any(f not in (0, 1) for f in flags):
        raise ValueError(f"no_rope_layers must hold a 0 or 1 for each of the {config.num_hidden_layers} layers, "
                         f"got {flags!r}")
    return [bool(f) for f in flags[:config.num_hidden_layers]]


class SmolLM3DecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int, *args, **kwargs):
        super().__init__(config, layer_idx, *args, **kwargs)
        self.self_attn.use_rope = rope_layers(config)[layer_idx]


@describes(SmolLM3DecoderLayer)
def _c_layer(layer: SmolLM3DecoderLayer, c: CDescriber) -> CPart:
    """As Llama's layers; its attention tells the C step whether it rotates (no_rope)."""
    return pre_norm_layer_part(layer, layer.self_attn, c)


class SmolLM3Model(DecoderModel):
    layer_class = SmolLM3DecoderLayer


class SmolLM3ForCausalLM(DecoderForCausalLM):
    """Llama's biases (attention_bias, mlp_bias), no q/k norm, tied head by default."""
    model_class = SmolLM3Model
