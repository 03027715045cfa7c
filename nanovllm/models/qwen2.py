"""Qwen2 / Qwen2.5: biased q/k/v projections, unbiased o_proj, no q/k norm, GQA, tied or untied head."""
from nanovllm.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    def __init__(self, config, quant_config=None):
        layer_types = getattr(config, "layer_types", None) or []
        if getattr(config, "use_sliding_window", False) or "sliding_attention" in layer_types:
            # Released Qwen2/2.5 checkpoints ship use_sliding_window=false; attending over a
            # window would need a masked backend path the engine does not have.
            raise ValueError("Qwen2 sliding-window attention (use_sliding_window=true) is not supported")
        super().__init__(config, quant_config)

    def attention_biases(self, config) -> tuple[bool, bool]:
        return True, False
