"""Llama 2/3.x and look-alikes (SmolLM2, TinyLlama): `attention_bias` on q/k/v/o, `mlp_bias` on the
MLP, RoPE with optional "llama3" frequency scaling, GQA, tied or untied head."""
from nanovllm.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """The shared decoder as is: its defaults (biases from `attention_bias` / `mlp_bias`, no q/k
    norm) are Llama's."""
