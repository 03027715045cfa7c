"""Processor: every check of a request before it is queued (vLLM's Processor): the prompt tokenized
and in the vocabulary, the sampling options this engine can honour, the KV cache able to hold it,
its grammar compiled. LLMEngine calls it; it changes no engine state, so a request it refuses
leaves nothing behind."""
from collections.abc import Callable

from nanovllm.config import Config
from nanovllm.engine.sequence import Sequence
from nanovllm.sample.structured_outputs import GrammarCache
from nanovllm.sampling_params import SamplingParams


class Processor:
    def __init__(self, config: Config, tokenizer, grammars: GrammarCache, num_kvcache_blocks: int,
                 blocks_held_at_most: Callable[[int, int], int], loras=None):
        """blocks_held_at_most(prompt_len, num_tokens): the most KV blocks such a sequence holds at
        once (the KV cache manager's count). loras: rank 0's LoRAModel (lora/layers.py) when the engine
        serves adapters: a request's adapter is read and checked here, before it is queued."""
        self.loras = loras
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = config.hf_config.vocab_size
        self.grammars = grammars
        self.num_kvcache_blocks = num_kvcache_blocks
        self.blocks_held_at_most = blocks_held_at_most

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is an empty string")
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise ValueError("prompt is an empty list of token ids")
            bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int)]
            if bad:
                raise TypeError(f"prompt token ids must be ints, got {bad[:4]!r}")
            return list(prompt)
        raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def checked_token_ids(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids, each checked to be in the vocabulary."""
        token_ids = self.tokenize(prompt)
        out_of_vocab = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if out_of_vocab:
            raise ValueError(f"prompt token ids {out_of_vocab[:4]} are outside the vocabulary [0, {self.vocab_size})")
        return token_ids

    def make_sequence(self, prompt: str | list[int], sampling_params: SamplingParams,
                      lora_request=None) -> Sequence:
        """Validate one request and wrap it as a Sequence; raises before touching any engine state."""
        adapter = self.lora_adapter(lora_request)
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        if self.config.runner == "pooling":
            raise ValueError("this engine runs the pooling runner (runner='pooling', `--runner pooling`): it "
                             "embeds (LLM.embed, /v1/embeddings) and does not generate")
        token_ids = self.checked_token_ids(prompt)
        max_len = self.config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, but max_model_len is {max_len} "
                             "(the prompt plus at least one new token must fit)")
        if sampling_params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model folder has none; use stop_token_ids")
        bad_stops = [t for t in sampling_params.stop_token_ids if t >= self.vocab_size]
        if bad_stops:
            raise ValueError(f"stop_token_ids {bad_stops[:4]} are outside the vocabulary [0, {self.vocab_size})")
        longest = min(len(token_ids) + (sampling_params.max_tokens or max_len), max_len)
        blocks_needed = self.blocks_held_at_most(len(token_ids), longest)
        if blocks_needed > self.num_kvcache_blocks:
            raise ValueError(f"request needs {blocks_needed} KV cache blocks ({longest} tokens) but the whole "
                             f"cache holds {self.num_kvcache_blocks}; lower max_tokens or give the cache more memory")
        if sampling_params.structured_outputs is not None:
            self.grammars.compile(sampling_params.structured_outputs)  # a bad spec fails here, unqueued
        seq = Sequence(token_ids, sampling_params)
        if adapter is not None:
            seq.lora_request, seq.cache_salt = lora_request, adapter.digest
        return seq

    def lora_adapter(self, lora_request):
        """The request's adapter (read and checked on first use), or None for the base model."""
        if lora_request is None:
            return None
        from nanovllm.lora.request import LoRARequest
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a nanovllm.lora.request.LoRARequest, got "
                            f"{type(lora_request).__name__}")
        if self.loras is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r}: this engine serves no adapters; start it "
                             "with enable_lora=True (`--enable-lora`)")
        return self.loras.adapter(lora_request)

    def embedding_prompts(self, prompts: list) -> list[list[int]]:
        """Prompts to embed, each checked (as generate() checks them) before any is run."""
        token_lists = []
        for prompt in prompts:
            tokens = self.checked_token_ids(prompt)
            if len(tokens) > self.config.max_model_len:
                raise ValueError(f"a prompt of {len(tokens)} tokens is longer than max_model_len "
                                 f"({self.config.max_model_len})")
            token_lists.append(tokens)
        return token_lists
