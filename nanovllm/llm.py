"""LLM: the user-facing facade. `LLM(model_dir, **engine_options).generate(prompts, params)`;
generate() and generate_stream() come from LLMEngine, chat() and LLM.default() are added here."""
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.chat_template import render_chat


class LLM(LLMEngine):
    """Offline inference: construct once, call generate() or chat() as often as needed."""

    @classmethod
    def default(cls, cache_dir: str | None = None, **kwargs) -> "LLM":
        """An engine over the default model, SmolLM2-135M-Instruct, downloaded on first use: on a CPU
        from its shipped Q4_1 GGUF file, on a GPU from the fp32 folder converted from it (see
        utils/default_model.py), sampling as its model card recommends unless generation_config
        is given; kwargs are the usual engine options."""
        from nanovllm.utils.default_model import default_generation_config, default_model
        path = default_model(cache_dir, kwargs.get("device", "auto"))
        kwargs.setdefault("generation_config", default_generation_config(cache_dir))  # its card's sampling
        return cls(path, **kwargs)

    def chat(self, messages: list[list[dict]] | list[dict],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[dict]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        prompts = [self.apply_chat_template(conv) for conv in messages]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[dict]) -> list[int]:
        """The prompt token ids of one conversation (the tokenizer's chat template, with the
        assistant's turn opened)."""
        return render_chat(self.tokenizer, conversation)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.exit()
