"""Qwen3 (dense): q/k RMSNorm per head, optional qkv bias (attention_bias), GQA, tied or untied head."""
from nanovllm.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    use_qk_norm = True

    def qkv_bias_for(self, config) -> bool:
        return bool(getattr(config, "attention_bias", False))
