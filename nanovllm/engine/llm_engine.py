"""LLMEngine: add_request / step / generate. Owns the tokenizer, the Scheduler and the ModelRunner."""
import logging
import os
import time

from tqdm.auto import tqdm

from nanovllm.config import CONFIG_FIELDS, Config
from nanovllm.executor.model_runner import ModelRunner
from nanovllm.outputs.output_processor import OutputProcessor
from nanovllm.outputs.parallel_sampling import PendingSiblings, child_params
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str):
    """The folder's HF tokenizer, or None for a weights-only folder (then prompts must be token ids)."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        # INFO, not a warning: weights-only folders are meant for token-id prompts (bench.py's), and
        # a string prompt or stop string then fails with a ValueError that says why.
        logger.info("%s has no tokenizer files: prompts must be token ids and outputs carry no text", path)
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        unknown = sorted(set(kwargs) - CONFIG_FIELDS)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {unknown}; known: {sorted(CONFIG_FIELDS - {'model'})}")
        self.config = config = Config(model, **kwargs)
        Sequence.block_size = config.kvcache_block_size
        self.tokenizer = load_tokenizer(config.model)
        if config.tensor_parallel_size > 1:
            from nanovllm.distributed.tp_runner import TensorParallelRunner
            self.model_runner = TensorParallelRunner(config)
        else:
            self.model_runner = ModelRunner(config)
        self.num_kvcache_blocks = self.model_runner.num_kvcache_blocks
        self.scheduler = Scheduler(config, self.num_kvcache_blocks)
        self.vocab_size = config.hf_config.vocab_size
        self.output_processor = OutputProcessor(self.tokenizer)
        self.pending_siblings = PendingSiblings()
        self.last_step_seqs: list[Sequence] = []

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

    def make_sequence(self, prompt: str | list[int], sampling_params: SamplingParams) -> Sequence:
        """Validate one request and wrap it as a Sequence; raises before touching any engine state."""
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        token_ids = self.tokenize(prompt)
        out_of_vocab = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if out_of_vocab:
            raise ValueError(f"prompt token ids {out_of_vocab[:4]} are outside the vocabulary [0, {self.vocab_size})")
        max_len = self.config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, but max_model_len is {max_len} "
                             "(the prompt plus at least one new token must fit)")
        if sampling_params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model folder has none; use stop_token_ids")
        bad_stops = [t for t in sampling_params.stop_token_ids if t >= self.vocab_size]
        if bad_stops:
            raise ValueError(f"stop_token_ids {bad_stops[:4]} are outside the vocabulary [0, {self.vocab_size})")
        block_size = self.config.kvcache_block_size
        longest = min(len(token_ids) + (sampling_params.max_tokens or max_len), max_len)
        blocks_needed = -(-longest // block_size)
        if blocks_needed > self.num_kvcache_blocks:
            raise ValueError(f"request needs {blocks_needed} KV cache blocks ({longest} tokens) but the whole "
                             f"cache holds {self.num_kvcache_blocks}; lower max_tokens or give the cache more memory")
        return Sequence(token_ids, sampling_params)

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams) -> Sequence:
        if isinstance(sampling_params, SamplingParams) and sampling_params.n > 1:
            raise ValueError(f"sampling_params.n={sampling_params.n} makes several sequences; "
                             "use add_request_group()")
        return self.add_request_group(prompt, sampling_params)[0]

    def add_request_group(self, prompt: str | list[int], sampling_params: SamplingParams) -> list[Sequence]:
        """Queue one prompt's sampling_params.n completions; returns their sequences."""
        seqs = self.make_group(prompt, sampling_params)
        self.queue_group(seqs)
        return seqs

    def make_group(self, prompt: str | list[int], sampling_params: SamplingParams) -> list[Sequence]:
        first = self.make_sequence(prompt, sampling_params)
        params = child_params(sampling_params)
        first.sampling_params = params[0]
        return [first] + [Sequence(first.prompt_token_ids, p) for p in params[1:]]

    def queue_group(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.output_processor.add(seq)
        self.scheduler.add(seqs[0])
        self.pending_siblings.hold(seqs[0], seqs[1:])

    def abort_request(self, seq: Sequence) -> None:
        was_held, siblings = self.pending_siblings.forget(seq)
        if was_held:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        self.scheduler.abort(seq)
        self.output_processor.finalize(seq)
        for sibling in siblings:  # they no longer wait for this one's prompt
            self.scheduler.add(sibling)

    # ---- stepping ---------------------------------------------------------------------------
    def step(self) -> tuple[list[Sequence], int]:
        """Run one step; returns the finished sequences and the number of tokens computed
        (positive for a prefill step, minus the batch size for a decode step)."""
        out = self.scheduler.schedule()
        self.last_step_seqs = out.seqs  # who to fail if this step raises (the async server's rule)
        if not out.seqs:
            return [], 0
        sampled = self.model_runner.run(out)
        finished = self.scheduler.postprocess(out, sampled.token_ids)
        for seq in self.output_processor.process(out.seqs, sampled.is_sampled, sampled.logprobs):
            self.scheduler.finish(seq, "stop")  # a stop string matched
            self.output_processor.finalize(seq)
            finished.append(seq)
        for seq in self.pending_siblings.release(out.seqs):
            self.scheduler.add(seq)
        num_tokens = out.num_tokens if out.is_prefill else -len(out.seqs)
        return finished, num_tokens

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and not self.pending_siblings

    def output_of(self, seq: Sequence) -> dict:
        """text, token_ids, finish_reason ("stop" / "length" / "abort"), stop_reason (the stop
        string or stop token id, None for EOS), prompt_token_ids; logprobs when asked."""
        return self.output_processor.output_of(seq)

    def group_output(self, seqs: list[Sequence]) -> dict:
        """One prompt's result: the first completion's fields at the top level (as with n=1),
        and "outputs", every completion's fields plus its "index"."""
        outputs = [dict(self.output_of(seq), index=i) for i, seq in enumerate(seqs)]
        return dict(outputs[0], outputs=outputs)

    @staticmethod
    def _normalize(prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
        """One prompt or a list of them, and one SamplingParams or one per prompt -> two lists."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list, got {type(prompts).__name__}")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        else:
            sampling_params = [sampling_params] * len(prompts)
        return list(prompts), list(sampling_params)

    def generate(self, prompts: list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        prompts, sampling_params = self._normalize(prompts, sampling_params)
        # Validate everything before queueing anything, so one bad prompt leaves the engine untouched.
        groups = [self.make_group(p, sp) for p, sp in zip(prompts, sampling_params)]
        for group in groups:
            self.queue_group(group)
        seqs = [seq for group in groups for seq in group]
        try:
            self._run_until_done(seqs, use_tqdm)
        except BaseException:
            for seq in seqs:
                self.abort_request(seq)
            raise
        return [self.group_output(group) for group in groups]

    def _run_until_done(self, seqs: list[Sequence], use_tqdm: bool) -> None:
        pending = {seq.seq_id for seq in seqs}
        bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        while pending:
            t = time.perf_counter()
            finished, num_tokens = self.step()
            dt = max(time.perf_counter() - t, 1e-9)
            if num_tokens > 0:
                prefill_tps = num_tokens / dt
            elif num_tokens < 0:
                decode_tps = -num_tokens / dt
            bar.set_postfix(prefill=f"{prefill_tps:.0f}tok/s", decode=f"{decode_tps:.0f}tok/s")
            done = [s for s in finished if s.seq_id in pending]
            pending.difference_update(s.seq_id for s in done)
            bar.update(len(done))
            if not done and num_tokens == 0 and self.is_finished():
                raise RuntimeError("engine stopped with requests still pending")
        bar.close()

    def exit(self) -> None:
        runner = getattr(self, "model_runner", None)
        if runner is not None:
            runner.exit()
            self.model_runner = None
