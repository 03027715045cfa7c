"""LLMEngine: add_request / step / generate / generate_stream. Owns the tokenizer, the Scheduler
and the ModelRunner."""
import logging
import os
import resource
from collections.abc import Iterator
from contextlib import closing
from typing import NamedTuple

from nanovllm.config import CONFIG_FIELDS, Config
from nanovllm.engine.kv_groups import slots_per_block
from nanovllm.executor.abstract import Executor
from nanovllm.executor.model_runner import ModelRunner
from nanovllm.outputs.output_processor import OutputProcessor
from nanovllm.outputs.parallel_sampling import PendingSiblings, child_params
from nanovllm.outputs.progress import GenerateProgress
from nanovllm.outputs.streaming import StreamDelta
from nanovllm.engine.scheduler import Scheduler, SchedulerOutput
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sample import structured_outputs
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class StepOutput(NamedTuple):
    """What one step() did."""

    finished: list[Sequence]   # the sequences that ended in this step
    num_tokens: int            # tokens computed: positive for prefill, minus the batch size for decode
    num_output_tokens: int     # tokens sampled (rows past their prompt)
    deltas: list[StreamDelta]  # each streamed request's new tokens and text (add_request_group(stream=True))


def startup_summary(config: Config, runner: Executor, num_blocks: int) -> str:
    """What a user wants to know once the engine is up: the model, where and in which dtypes it
    runs, the memory taken, how many tokens the KV cache holds."""
    arch = (getattr(config.hf_config, "architectures", None) or ["?"])[0]
    dtypes = str(config.torch_dtype).removeprefix("torch.")
    if config.weight_dtype != config.torch_dtype:
        dtypes += f" activations, {str(config.weight_dtype).removeprefix('torch.')} weights"
    tp = f", {config.tensor_parallel_size} tensor-parallel ranks" if config.tensor_parallel_size > 1 else ""
    kv_bytes = num_blocks * runner.kv_block_bytes()
    tokens = kv_bytes // runner.kv_token_bytes()  # of every layer (engine/kv_groups.py: sliding groups hold fewer)
    kv_mib = kv_bytes / 2**20
    groups, kinds, layers = runner.kv_groups, "", ""
    if len(groups) > 1:  # engine/kv_groups.py
        layers = f" tokens x {slots_per_block(groups)} layers"
        windows = sorted({g.window for g in groups}, key=lambda w: w or 0)
        kinds = "; block tables: " + ", ".join(
            f"{sum(1 for g in groups if g.window == w)} of {'full' if w is None else f'window-{w}'} layers"
            for w in windows)
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return (f"model {os.path.basename(config.model.rstrip('/'))} ({arch}) on {config.device}{tp}, {dtypes}; "
            f"KV cache {tokens} tokens in {config.kv_format.name}, {runner.kv_token_bytes()} bytes per token "
            f"({num_blocks} blocks of {config.kvcache_block_size}{layers}{kinds}), {kv_mib:.0f} MiB per rank "
            f"{config.platform.kv_cache_holding(config.kvcache_prefault)}; "
            f"peak RSS {peak_rss_mib:.0f} MiB")


def sampling_defaults_line(config: Config) -> str:
    """Where the sampling defaults come from and what they mean for a request: a sampled default
    (a model card's temperature) makes the same question come back differently."""
    from nanovllm.utils.default_model import GENERATION_DIRNAME
    source = config.generation_config
    if source == "auto":
        source = "the model's generation config"
    elif os.path.basename(source.rstrip("/")) == GENERATION_DIRNAME:
        source = "the default model's card"
    else:
        source = f"generation_config {source!r}"
    if config.override_generation_config:
        source += " and override_generation_config"
    fields = ", ".join(f"{k}={v}" for k, v in config.sampling_defaults.items())
    line = f"sampling defaults from {source}: {fields}: requests that leave a field unset take it"
    if config.sampling_defaults.get("temperature", 1.0) > 0:
        line += "; send temperature=0 for a deterministic (greedy) answer"
    if config.max_tokens_ceiling is not None:
        line += f"; no request gets more than {config.max_tokens_ceiling} tokens"
    return line + " (generation_config='vllm' / --generation-config vllm: none)"


def _as_prompt_list(prompts):
    """One prompt (a string or a list of token ids) as a list of one; anything else as given."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return prompts


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        unknown = sorted(set(kwargs) - CONFIG_FIELDS)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {unknown}; known: {sorted(CONFIG_FIELDS - {'model'})}")
        self.model_runner: Executor | None = None
        self.speculator = None
        self.config = config = Config(model, **kwargs)
        self.tokenizer = config.checkpoint.load_tokenizer()
        if config.tensor_parallel_size > 1:
            from nanovllm.distributed.tp_runner import TensorParallelRunner
            self.model_runner = TensorParallelRunner(config)
        else:
            self.model_runner = ModelRunner(config)
        runner = self.model_runner
        self.num_kvcache_blocks = runner.num_kvcache_blocks
        logger.info("%s", startup_summary(config, runner, self.num_kvcache_blocks))
        if config.sampling_defaults:
            logger.info("%s", sampling_defaults_line(config))
        self.scheduler = Scheduler(config, self.num_kvcache_blocks, [group.window for group in runner.kv_groups],
                                   runner.num_state_slots)
        if runner.num_state_slots and config.enable_prefix_caching:
            logger.info("prefix caching is off: this model's linear-attention layers keep a state per sequence, "
                        "not per block")
        if config.speculative_config is not None:
            from nanovllm.spec_decode.build import build_speculator
            self.speculator = build_speculator(config, self.tokenizer, self.model_runner, self.num_kvcache_blocks)
        self.vocab_size = config.hf_config.vocab_size
        self.output_processor = OutputProcessor(self.tokenizer)
        self.grammars = structured_outputs.GrammarCache(self.tokenizer, self.vocab_size, config.eos_token_ids)
        self.pending_siblings = PendingSiblings()
        self._step_request_ids: set | None = set()

    # ---- requests ---------------------------------------------------------------------------
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

    def make_sequence(self, prompt: str | list[int], sampling_params: SamplingParams) -> Sequence:
        """Validate one request and wrap it as a Sequence; raises before touching any engine state."""
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
        blocks_needed = self.scheduler.block_manager.blocks_held_at_most(len(token_ids), longest)
        if blocks_needed > self.num_kvcache_blocks:
            raise ValueError(f"request needs {blocks_needed} KV cache blocks ({longest} tokens) but the whole "
                             f"cache holds {self.num_kvcache_blocks}; lower max_tokens or give the cache more memory")
        if sampling_params.structured_outputs is not None:
            self.grammars.compile(sampling_params.structured_outputs)  # a bad spec fails here, unqueued
        return Sequence(token_ids, sampling_params)

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams) -> Sequence:
        if isinstance(sampling_params, SamplingParams) and sampling_params.n > 1:
            raise ValueError(f"sampling_params.n={sampling_params.n} makes several sequences; "
                             "use add_request_group()")
        return self.add_request_group(prompt, sampling_params)[0]

    def add_request_group(self, prompt: str | list[int], sampling_params: SamplingParams,
                          request_id: object = None, stream: bool = False) -> list[Sequence]:
        """Queue one prompt's sampling_params.n completions; returns their sequences. With stream,
        step() returns their deltas (StreamDelta, keyed by request_id and completion index)."""
        seqs = self.make_group(prompt, sampling_params)
        self.queue_group(seqs, request_id, stream)
        return seqs

    def make_group(self, prompt: str | list[int], sampling_params: SamplingParams) -> list[Sequence]:
        first = self.make_sequence(prompt, sampling_params)
        params = child_params(sampling_params)
        first.sampling_params = params[0]
        seqs = [first] + [Sequence(first.prompt_token_ids, p) for p in params[1:]]
        if sampling_params.structured_outputs is not None:
            for seq in seqs:  # each completion walks the grammar on its own
                seq.grammar = self.grammars.new_matcher(sampling_params.structured_outputs)
        return seqs

    def queue_group(self, seqs: list[Sequence], request_id: object = None, stream: bool = False) -> None:
        request_id = seqs[0].seq_id if request_id is None else request_id
        for index, seq in enumerate(seqs):
            self.output_processor.add(seq, request_id, index, stream)
        self.scheduler.add(seqs[0])
        self.pending_siblings.hold(seqs[0], seqs[1:])

    def abort_request(self, seq: Sequence) -> None:
        was_held, siblings = self.pending_siblings.forget(seq)
        if was_held:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        self.scheduler.abort(seq)
        if self.speculator is not None:
            self.speculator.forget(seq)
        self.output_processor.finalize(seq)
        for sibling in siblings:  # they no longer wait for this one's prompt
            self.scheduler.add(sibling)

    # ---- stepping ---------------------------------------------------------------------------
    def step(self) -> StepOutput:
        """Run one step: schedule, run the model, apply its tokens, match stop strings.
        NOTE: an exception after the sequences were chosen carries their request ids as
        `step_request_ids` (the requests a server fails); one raised by schedule() carries none."""
        out = self.scheduler.schedule()
        if not out.seqs:
            return StepOutput([], 0, 0, [])
        try:
            return self._run_step(out)
        except Exception as e:
            e.step_request_ids = self.output_processor.request_ids(out.seqs)
            raise

    def _run_step(self, out: SchedulerOutput) -> StepOutput:
        if self.speculator is not None:
            # decode: proposals into out; prefill: the proposer sees it (while it could pay with the
            # sequences that will decode together: those running and those waiting, up to max_num_seqs)
            decoding = min(self.config.max_num_seqs, len(self.scheduler.running) + len(self.scheduler.waiting))
            self.speculator.propose(out, decoding)
        sampled = self.model_runner.run(out)
        more = sampled.more_token_ids
        if more is None:
            finished = self._apply(out, sampled.token_ids, sampled.is_sampled, sampled.logprobs, sampled.prompt_logprobs)
        else:  # a verification: each row's emitted tokens applied one at a time, as decode steps would
            self.speculator.record(out, sampled)
            first = SchedulerOutput(out.seqs, [1] * len(out.seqs), is_prefill=False)
            finished = self._apply(first, sampled.token_ids, sampled.is_sampled, sampled.logprobs, None)
            for j in range(max(map(len, more), default=0)):
                rows = [i for i, m in enumerate(more) if j < len(m) and not out.seqs[i].is_finished]
                sub = SchedulerOutput([out.seqs[i] for i in rows], [1] * len(rows), is_prefill=False)
                finished += self._apply(sub, [more[i][j] for i in rows], [True] * len(rows),
                                        [sampled.more_logprobs[i][j] for i in rows], None)
        deltas = self.output_processor.finish_step(out.seqs)
        for seq in self.pending_siblings.release(out.seqs):
            self.scheduler.add(seq)
        if self.speculator is not None:
            for seq in finished:
                self.speculator.forget(seq)
        num_tokens = out.num_tokens if out.is_prefill else -len(out.seqs)
        num_output = sum(sampled.is_sampled) + (sum(map(len, more)) if more is not None else 0)
        return StepOutput(finished, num_tokens, num_output, deltas)

    def _apply(self, out: SchedulerOutput, token_ids: list[int], is_sampled: list[bool],
               logprobs: list, prompt_logprobs) -> list[Sequence]:
        """One token per row of out: append it, end sequences (EOS, stop tokens, lengths, a grammar's
        end, stop strings), record text and logprobs. Returns those that finished."""
        finished = self.scheduler.postprocess(out, token_ids)
        for seq in structured_outputs.advance(out.seqs, is_sampled):
            self.scheduler.finish(seq, "stop")  # its grammar ended (on EOS, even under ignore_eos)
            finished.append(seq)
        self.output_processor.add_prompt_logprobs(out.seqs, prompt_logprobs)
        for seq in self.output_processor.process(out.seqs, is_sampled, logprobs):
            self.scheduler.finish(seq, "stop")  # a stop string matched
            finished.append(seq)
        return finished

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and not self.pending_siblings

    def broken_reason(self) -> str | None:
        """Why this engine can run no further step (a tensor-parallel worker died, a failed step left
        the ranks apart, it exited), or None while it can. Cheap: the server asks every second."""
        if self.model_runner is None:
            return "the engine has exited"
        return self.model_runner.broken_reason()

    def output_of(self, seq: Sequence) -> dict:
        """text, token_ids, finish_reason ("stop" / "length" / "abort"), stop_reason (the stop
        string or stop token id, None for EOS), prompt_token_ids; logprobs when asked."""
        return self.output_processor.output_of(seq)

    def group_output(self, seqs: list[Sequence]) -> dict:
        """One prompt's result: the first completion's fields at the top level (as with n=1),
        and "outputs", every completion's fields plus its "index"."""
        outputs = [dict(self.output_of(seq), index=i) for i, seq in enumerate(seqs)]
        return dict(outputs[0], outputs=outputs)

    def embed(self, prompts: list[str] | list[list[int]] | str, pooling: str | None = None,
              normalize: bool = True) -> list[list[float]]:
        """One embedding per prompt: its final hidden states pooled (pooling: "last", "mean" or
        "cls"; None: what the checkpoint says, else the last token) and L2-normalised. Every prompt
        is checked first (as generate() checks them); nothing enters the KV cache."""
        token_lists = []
        for prompt in _as_prompt_list(prompts):
            tokens = self.checked_token_ids(prompt)
            if len(tokens) > self.config.max_model_len:
                raise ValueError(f"a prompt of {len(tokens)} tokens is longer than max_model_len "
                                 f"({self.config.max_model_len})")
            token_lists.append(tokens)
        method = pooling or self.config.checkpoint.pooling
        return self.model_runner.embed(token_lists, method, normalize).tolist()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's sampling defaults (Config.generation_config), what
        generate() uses when given none (vLLM's name)."""
        return SamplingParams(**self.config.sampling_defaults)

    def _normalize(self, prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
        """One prompt or a list of them, and one SamplingParams or one per prompt -> two lists."""
        prompts = _as_prompt_list(prompts)
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list, got {type(prompts).__name__}")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        else:
            sampling_params = [sampling_params] * len(prompts)
        return list(prompts), list(sampling_params)

    def generate(self, prompts: list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        """Every prompt's output (group_output), in prompt order."""
        groups = self._make_groups(prompts, sampling_params)
        progress = GenerateProgress([seq for group in groups for seq in group], enabled=use_tqdm)
        try:
            with closing(self._run(groups, stream=False)) as steps:
                for step in steps:
                    progress.update(step.finished, step.num_tokens, step.num_output_tokens)
        finally:
            progress.close()
        return [self.group_output(group) for group in groups]

    def generate_stream(self, prompts: list[str] | list[list[int]],
                        sampling_params: SamplingParams | list[SamplingParams] | None = None,
                        ) -> Iterator[StreamDelta]:
        """Like generate(), but yields each request's new tokens and text as they are produced.

        A delta's request_id is its prompt's position in `prompts`, its index the completion's
        number among that prompt's n. Closing the iterator early (break, or garbage collection)
        aborts the unfinished requests and frees their KV blocks.
        """
        groups = self._make_groups(prompts, sampling_params)
        with closing(self._run(groups, stream=True)) as steps:  # closing this closes _run at once
            for step in steps:
                yield from step.deltas

    def _make_groups(self, prompts, sampling_params) -> list[list[Sequence]]:
        prompts, sampling_params = self._normalize(prompts, sampling_params)
        # Validate everything before queueing anything, so one bad prompt leaves the engine untouched.
        return [self.make_group(p, sp) for p, sp in zip(prompts, sampling_params)]

    def _run(self, groups: list[list[Sequence]], stream: bool) -> Iterator[StepOutput]:
        """Queue the groups (request_id: their position), then step until all of them finished,
        yielding every step. NOTE: the one abort path: leaving early (an exception, break, close,
        garbage collection) aborts the unfinished sequences and frees their KV blocks."""
        seqs = [seq for group in groups for seq in group]
        for i, group in enumerate(groups):
            self.queue_group(group, request_id=i, stream=stream)
        pending = {seq.seq_id for seq in seqs}
        try:
            while pending:
                step = self.step()
                pending.difference_update(seq.seq_id for seq in step.finished)
                if pending and step.num_tokens == 0:  # nothing ran: were the rest aborted by hand?
                    pending = {seq.seq_id for seq in seqs if not seq.is_finished}
                    if pending and self.is_finished():
                        raise RuntimeError("engine stopped with requests still pending")
                yield step
        finally:
            for seq in seqs:
                if not seq.is_finished:
                    self.abort_request(seq)

    def exit(self) -> None:
        if self.speculator is not None:
            self.speculator.exit()
            self.speculator = None
        if self.model_runner is not None:
            self.model_runner.exit()
            self.model_runner = None
