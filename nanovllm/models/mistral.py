"""Mistral (7B v0.1-style, Ministral, Mistral Small/Nemo as Llama-shaped decoders): Llama's blocks
with a sliding window on every layer where config.sliding_window is set (decoder.layer_type_of)."""
from nanovllm.models.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    """The shared decoder as is: no biases, GQA, the window read from the config per layer."""
