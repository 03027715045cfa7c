"""Qwen3 (dense): q/k RMSNorm per head, optional q/k/v/o bias (attention_bias), GQA, tied or untied head."""
from nanovllm.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    use_qk_norm = True
