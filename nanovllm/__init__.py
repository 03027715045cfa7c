"""nano-vLLM: a small, readable LLM inference engine. Users import LLM and SamplingParams."""
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams
from nanovllm.utils.default_model import default_model_path

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "default_model_path"]
