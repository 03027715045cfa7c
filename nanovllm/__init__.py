"""nano-vLLM: a small, readable LLM inference engine. Users import LLM and SamplingParams."""
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
