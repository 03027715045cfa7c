"""nano-vLLM: a small, readable LLM inference engine. Users import LLM and SamplingParams."""
from nanovllm.utils.threads import set_wait_default

set_wait_default()  # before anything below imports torch (and with it the OpenMP runtime)

from nanovllm.llm import LLM  # noqa: E402
from nanovllm.lora.request import LoRARequest  # noqa: E402
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from nanovllm.utils.default_model import default_model_path  # noqa: E402

__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "default_model_path"]
