"""LLMEngine: add_request / step / generate. Owns the tokenizer, the Scheduler and the ModelRunner."""
import logging
import os
import time

from tqdm.auto import tqdm

from nanovllm.config import CONFIG_FIELDS, Config
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str):
    """The folder's HF tokenizer, or None for a weights-only folder (then prompts must be token ids)."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        logger.warning("%s has no tokenizer files: prompts must be token ids and outputs carry no text", path)
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
        self.model_runner = ModelRunner(config)
        self.num_kvcache_blocks = self.model_runner.num_kvcache_blocks
        self.scheduler = Scheduler(config, self.num_kvcache_blocks)
        self.vocab_size = config.hf_config.vocab_size
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
        block_size = self.config.kvcache_block_size
        longest = min(len(token_ids) + sampling_params.max_tokens, max_len)
        blocks_needed = -(-longest // block_size)
        if blocks_needed > self.num_kvcache_blocks:
            raise ValueError(f"request needs {blocks_needed} KV cache blocks ({longest} tokens) but the whole "
                             f"cache holds {self.num_kvcache_blocks}; lower max_tokens or give the cache more memory")
        return Sequence(token_ids, sampling_params)

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams) -> Sequence:
        seq = self.make_sequence(prompt, sampling_params)
        self.scheduler.add(seq)
        return seq

    def abort_request(self, seq: Sequence) -> None:
        self.scheduler.abort(seq)

    # ---- stepping ---------------------------------------------------------------------------
    def step(self) -> tuple[list[Sequence], int]:
        """Run one step; returns the finished sequences and the number of tokens computed
        (positive for a prefill step, minus the batch size for a decode step)."""
        out = self.scheduler.schedule()
        self.last_step_seqs = out.seqs  # who to fail if this step raises (the async server's rule)
        if not out.seqs:
            return [], 0
        token_ids = self.model_runner.run(out)
        finished = self.scheduler.postprocess(out, token_ids)
        num_tokens = out.num_tokens if out.is_prefill else -len(out.seqs)
        return finished, num_tokens

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def output_of(self, seq: Sequence) -> dict:
        token_ids = seq.completion_token_ids
        return {
            "text": self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer else None,
            "token_ids": token_ids,
            "finish_reason": seq.finish_reason,
            "prompt_token_ids": seq.prompt_token_ids,
        }

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
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]
        for seq in seqs:
            self.scheduler.add(seq)
        try:
            self._run_until_done(seqs, use_tqdm)
        except BaseException:
            for seq in seqs:
                self.scheduler.abort(seq)
            raise
        return [self.output_of(seq) for seq in seqs]

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
