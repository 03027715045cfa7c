"""Model registry keyed by config.architectures[0]; model modules are imported lazily."""
import importlib

_MODELS = {
    "Qwen3ForCausalLM": "nanovllm.models.qwen3:Qwen3ForCausalLM",
    "Qwen2ForCausalLM": "nanovllm.models.qwen2:Qwen2ForCausalLM",
    "LlamaForCausalLM": "nanovllm.models.llama:LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "nanovllm.models.qwen_moe:Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM": "nanovllm.models.qwen_moe:Qwen2MoeForCausalLM",
    "MixtralForCausalLM": "nanovllm.models.mixtral:MixtralForCausalLM",
    "MistralForCausalLM": "nanovllm.models.mistral:MistralForCausalLM",
    "SmolLM3ForCausalLM": "nanovllm.models.smollm3:SmolLM3ForCausalLM",
    "GptOssForCausalLM": "nanovllm.models.gpt_oss:GptOssForCausalLM",
    "Glm4MoeForCausalLM": "nanovllm.models.glm4_moe:Glm4MoeForCausalLM",
    "Lfm2ForCausalLM": "nanovllm.models.lfm2:Lfm2ForCausalLM",
    "GraniteMoeHybridForCausalLM": "nanovllm.models.granite_hybrid:GraniteMoeHybridForCausalLM",
    "FalconH1ForCausalLM": "nanovllm.models.falcon_h1:FalconH1ForCausalLM",
    "Lfm2MoeForCausalLM": "nanovllm.models.lfm2:Lfm2MoeForCausalLM",
    "Gemma2ForCausalLM": "nanovllm.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "nanovllm.models.gemma:Gemma3ForCausalLM",
    "Qwen3_5ForCausalLM": "nanovllm.models.qwen3_next:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM": "nanovllm.models.qwen3_next:Qwen3_5MoeForCausalLM",
    "Qwen3NextForCausalLM": "nanovllm.models.qwen3_next:Qwen3NextForCausalLM",
}

# A target's multi-token-prediction head as a model of its own, for a speculative proposer to build
# from the target's checkpoint (models/qwen3_next.py, MtpHeadMixin).
_MTP_HEADS = {
    "Qwen3_5ForCausalLM": "nanovllm.models.qwen3_next:Qwen3_5MTP",
    "Qwen3_5MoeForCausalLM": "nanovllm.models.qwen3_next:Qwen3_5MoeMTP",
    "Qwen3NextForCausalLM": "nanovllm.models.qwen3_next:Qwen3NextMTP",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def _load(registry: dict[str, str], hf_config, what: str):
    """The class registry names for hf_config's architecture; ValueError naming what it has."""
    archs = getattr(hf_config, "architectures", None) or []
    if not archs or archs[0] not in registry:
        name = archs[0] if archs else "(none given in config.json)"
        raise ValueError(f"{what} {name}; supported: {sorted(registry)}")
    module_name, cls_name = registry[archs[0]].split(":")
    return getattr(importlib.import_module(module_name), cls_name)


def get_model_class(hf_config):
    return _load(_MODELS, hf_config, "unsupported model architecture")


def get_mtp_head_class(hf_config):
    """The MTP head model of a target's architecture; ValueError for a family without one."""
    return _load(_MTP_HEADS, hf_config, "no MTP head model for architecture")
