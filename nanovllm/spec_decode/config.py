"""SpeculativeConfig: vLLM's `speculative_config` dict, validated once, before anything starts.

    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}
    {"method": "draft_model", "model": PATH, "num_speculative_tokens": k}

Also accepted: "disable_by_batch_size" (no proposals while this many sequences or more decode in
one step; vLLM's name), "quantization" (the draft's weight format, as LLM(quantization=...): a
q4_0 copy of the target drafting for its full-precision self), "max_model_len" (ignored: the draft
follows the target's). EAGLE / MTP heads have their seat (spec_decode/proposer.py) but no proposer
yet: asking for one is a clear error. (The hybrids' MTP heads load as models of their own:
models.get_mtp_head_class; running them needs the target's hidden states, which no step returns yet.)
"""
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
NOT_BUILT = ("eagle", "eagle3", "mtp", "medusa", "suffix")
MAX_SPECULATIVE_TOKENS = 16
# Decode batches of this many sequences or more get no proposals. Measured on 2 AVX2 cores
# (docs/performance.md, "Speculation's cost model"): verification rows cost little next to one row while the step reads its
# weights once for few rows; at 16 and more rows the matmuls are compute-bound, and a rejected
# proposal then costs about as much as the token it replaces.
DEFAULT_DISABLE_BY_BATCH_SIZE = 16
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
         "disable_by_batch_size", "quantization", "max_model_len"}


def _int_in(name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative_config.{name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"speculative_config.{name} must be in {bound}, got {value}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None          # draft_model: the draft's checkpoint (folder or .gguf file)
    quantization: str | None = None   # draft_model: its weight format, as LLM(quantization=...)
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @property
    def reads_target_block_table(self) -> bool:
        """Whether the proposer keeps a KV cache indexed by the target's block table (a draft model:
        one table for every layer, so the target's KV groups share it: Config.split_kv_groups)."""
        return self.method == "draft_model"

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """A SpeculativeConfig from a dict (or one already built); None stays None. ValueError
        naming the first bad field."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; known: {sorted(_KEYS)}")
        method = value.get("method")
        if method is None:
            method = "draft_model" if value.get("model") is not None else None
        if method in NOT_BUILT:
            raise ValueError(f"speculative_config.method {method!r} is not built yet; use one of {list(METHODS)}")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, got {method!r}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        k = _int_in("num_speculative_tokens", value["num_speculative_tokens"], 1, MAX_SPECULATIVE_TOKENS)
        kwargs: dict = {"method": method, "num_speculative_tokens": k}
        if "disable_by_batch_size" in value and value["disable_by_batch_size"] is not None:
            kwargs["disable_by_batch_size"] = _int_in("disable_by_batch_size", value["disable_by_batch_size"], 1)
        if method == "ngram":
            for key in ("model", "quantization"):
                if value.get(key) is not None:
                    raise ValueError(f"speculative_config.{key} is for method 'draft_model', not 'ngram'")
            hi = _int_in("prompt_lookup_max", value.get("prompt_lookup_max", cls.prompt_lookup_max), 1, 64)
            lo = _int_in("prompt_lookup_min", value.get("prompt_lookup_min", min(cls.prompt_lookup_min, hi)), 1, 64)
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            kwargs.update(prompt_lookup_max=hi, prompt_lookup_min=lo)
        else:
            for key in ("prompt_lookup_max", "prompt_lookup_min"):
                if key in value:
                    raise ValueError(f"speculative_config.{key} is for method 'ngram', not 'draft_model'")
            model = value.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError("speculative_config.model (the draft's checkpoint path) is required for 'draft_model'")
            kwargs.update(model=model, quantization=value.get("quantization"))
        return cls(**kwargs)
