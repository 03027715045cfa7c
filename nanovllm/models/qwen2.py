"""Qwen2 / Qwen2.5: biased q/k/v projections, unbiased o_proj, no q/k norm, GQA, tied or untied head;
sliding-window layers where the config asks (use_sliding_window, through layer_types)."""
from nanovllm.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    def attention_biases(self, config) -> tuple[bool, bool]:
        return True, False
