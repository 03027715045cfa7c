"""LLMEngine: add_request / step / abort_request (vLLM's engine). Owns the tokenizer, the request
checks (Processor), the Scheduler and the Executor; LLM (llm.py) drives it offline, the async
engine (entrypoints/async_engine.py) for the server."""
import logging
from typing import NamedTuple

from nanovllm.config import CONFIG_FIELDS, Config
from nanovllm.engine.processor import Processor
from nanovllm.engine.startup_log import sampling_defaults_line, startup_summary
from nanovllm.executor.abstract import Executor
from nanovllm.executor.model_runner import ModelRunner
from nanovllm.kv_offload.connector import TierConnector, build_tier
from nanovllm.outputs.output_processor import OutputProcessor
from nanovllm.outputs.parallel_sampling import PendingSiblings, child_params
from nanovllm.outputs.streaming import StreamDelta
from nanovllm.engine.scheduler import Scheduler, SchedulerOutput
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sample import structured_outputs
from nanovllm.sample.sampler import SampledTokens
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class StepOutput(NamedTuple):
    """What one step() did."""

    finished: list[Sequence]   # the sequences that ended in this step
    num_tokens: int            # tokens computed: positive for prefill, minus the batch size for decode
    num_output_tokens: int     # tokens sampled (rows past their prompt)
    deltas: list[StreamDelta]  # each streamed request's new tokens and text (add_request_group(stream=True))


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        unknown = sorted(set(kwargs) - CONFIG_FIELDS)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {unknown}; known: {sorted(CONFIG_FIELDS - {'model'})}")
        self.model_runner: Executor | None = None
        self.speculator = None
        self.connector: TierConnector | None = None
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
        for note in runner.step_notes:  # a faster step path that stays off (which part, and why)
            logger.warning("%s", note)
        if config.sampling_defaults:
            logger.info("%s", sampling_defaults_line(config))
        tier = build_tier(config, runner)  # under the prefix cache (kv_offload/), when asked for
        if tier is not None:
            logger.info("%s", tier.describe())
        spec = config.speculative_config  # its proposals fill KV slots held past each decoding token
        self.scheduler = Scheduler(config, self.num_kvcache_blocks, [group.window for group in runner.kv_groups],
                                   runner.num_state_slots, spec.num_speculative_tokens if spec else 0,
                                   spec.disable_by_batch_size if spec else 0, tier)
        self.connector = TierConnector(tier, self.scheduler, runner) if tier is not None else None
        if runner.num_state_slots and config.enable_prefix_caching:
            logger.info("prefix caching is off: this model's state layers (linear attention, convolutions, Mamba-2) keep "
                        "a state per sequence, not per block")
        if config.speculative_config is not None:
            from nanovllm.spec_decode.build import build_speculator
            self.speculator = build_speculator(config, self.tokenizer, self.model_runner, self.num_kvcache_blocks)
        self.vocab_size = config.hf_config.vocab_size
        self.output_processor = OutputProcessor(self.tokenizer)
        self.grammars = structured_outputs.GrammarCache(self.tokenizer, self.vocab_size, config.eos_token_ids)
        self.processor = Processor(config, self.tokenizer, self.grammars, self.num_kvcache_blocks,
                                   self.scheduler.kv_cache_manager.blocks_held_at_most, runner.lora)
        self.pending_siblings = PendingSiblings()
        self._step_request_ids: set | None = set()

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams, lora_request=None) -> Sequence:
        if isinstance(sampling_params, SamplingParams) and sampling_params.n > 1:
            raise ValueError(f"sampling_params.n={sampling_params.n} makes several sequences; "
                             "use add_request_group()")
        return self.add_request_group(prompt, sampling_params, lora_request=lora_request)[0]

    def add_request_group(self, prompt: str | list[int], sampling_params: SamplingParams,
                          request_id: object = None, stream: bool = False, lora_request=None) -> list[Sequence]:
        """Queue one prompt's sampling_params.n completions; returns their sequences. With stream,
        step() returns their deltas (StreamDelta, keyed by request_id and completion index)."""
        seqs = self.make_group(prompt, sampling_params, lora_request)
        self.queue_group(seqs, request_id, stream)
        return seqs

    def make_group(self, prompt: str | list[int], sampling_params: SamplingParams,
                   lora_request=None) -> list[Sequence]:
        """One prompt's sampling_params.n sequences, checked (Processor) but not queued; lora_request:
        the adapter they run with (lora/request.py), None for the base model."""
        first = self.processor.make_sequence(prompt, sampling_params, lora_request)
        params = child_params(sampling_params)
        first.sampling_params = params[0]
        seqs = [first] + [Sequence(first.prompt_token_ids, p) for p in params[1:]]
        for seq in seqs[1:]:
            seq.lora_request, seq.cache_salt = first.lora_request, first.cache_salt
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

    def forget_lora(self, request) -> None:
        """An adapter unloaded by the server: its idle slot emptied and its host copy dropped (requests
        still running with it keep it, and read it again if they need it back after a preemption)."""
        if self.scheduler.loras is not None:
            self.scheduler.loras.evict(request)
        if self.model_runner.lora is not None:
            self.model_runner.lora.forget(request)

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
        if self.connector is not None:
            self.connector.before_step()  # finished tier reads into the cache, their sequences queued
        out = self.scheduler.schedule()
        if not out.seqs:
            if self.connector is not None:
                self.connector.wait(0.02)  # only tier reads in flight: wait for one, not spin
            return StepOutput([], 0, 0, [])
        try:
            return self._run_step(out)
        except Exception as e:
            e.step_request_ids = self.output_processor.request_ids(out.seqs)
            raise

    def _run_step(self, out: SchedulerOutput) -> StepOutput:
        drafts = None
        if self.speculator is not None:
            # decode: proposals beside the step; prefill: the proposer sees it (while it could pay with
            # the sequences that will decode together: those running and those waiting, up to max_num_seqs)
            decoding = min(self.config.max_num_seqs, len(self.scheduler.running) + len(self.scheduler.waiting))
            drafts = self.speculator.propose(out, decoding)
        if drafts is None:
            sampled = self.model_runner.run(out)
        else:
            sampled = self.model_runner.run(out, drafts)
            self.speculator.record(out.seqs, drafts, sampled)
        finished = self._apply(out, sampled)
        if self.connector is not None:
            self.connector.after_step()  # the blocks this step hashed, queued for the tier
        deltas = self.output_processor.finish_step(out.seqs)
        for seq in self.pending_siblings.release(out.seqs):
            self.scheduler.add(seq)
        if self.speculator is not None:
            for seq in finished:
                self.speculator.forget(seq)
        num_tokens = out.num_tokens if out.is_prefill else -len(out.seqs)
        return StepOutput(finished, num_tokens, sampled.num_emitted, deltas)

    def _apply(self, out: SchedulerOutput, sampled: SampledTokens) -> list[Sequence]:
        """Each row's tokens in turn (one; several where the step verified proposals), as decode
        steps would apply them: append, end the sequence (EOS, stop tokens, lengths, a grammar's end,
        stop strings: the row's later tokens are then dropped), record text and logprobs. Returns
        the sequences that finished."""
        self.output_processor.add_prompt_logprobs(out.seqs, sampled.prompt_logprobs)

        def after_token(row: int, seq: Sequence, j: int) -> bool:
            if not sampled.is_sampled[row]:
                return False
            ended = False
            if structured_outputs.advance_one(seq):
                self.scheduler.finish(seq, "stop")  # its grammar ended (on EOS, even under ignore_eos)
                ended = True
            if self.output_processor.process_one(seq, sampled.logprobs[row][j]):
                self.scheduler.finish(seq, "stop")  # a stop string matched
                ended = True
            return ended
        return self.scheduler.postprocess(out, sampled.token_ids, after_token)

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

    def embed(self, prompts: list[str] | list[list[int]], pooling: str | None = None,
              normalize: bool = True, lora_request=None) -> list[list[float]]:
        """One embedding per prompt: its final hidden states pooled (pooling: "last", "mean" or
        "cls"; None: what the checkpoint says, else the last token) and L2-normalised. Every prompt
        is checked first (as generate() checks them); nothing enters the KV cache. lora_request: the
        adapter every prompt runs with (a slot of the scheduler's, held for the call)."""
        token_lists = self.processor.embedding_prompts(prompts)
        method = pooling or self.config.checkpoint.pooling
        if lora_request is None:
            return self.model_runner.embed(token_lists, method, normalize).tolist()
        self.processor.lora_adapter(lora_request)  # read and checked, or a LoRAError naming it
        holder = Sequence([0])
        holder.lora_request = lora_request
        slots = self.scheduler.loras
        if not slots.can_admit(holder):
            from nanovllm.lora.slots import LoRASlotsBusy
            raise LoRASlotsBusy(f"lora_request {lora_request.lora_name!r}: all {len(slots.table)} adapter slots are "
                                "held by running requests' adapters (max_loras); embed once they finish")
        slots.acquire(holder)
        try:
            return self.model_runner.embed(token_lists, method, normalize,
                                           (tuple(slots.table), holder.lora_slot)).tolist()
        finally:
            slots.release(holder)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's sampling defaults (Config.generation_config), what
        generate() uses when given none (vLLM's name)."""
        return SamplingParams(**self.config.sampling_defaults)

    def exit(self) -> None:
        if self.connector is not None:
            self.connector.close()  # its queued writes finish first
            self.connector = None
        if self.speculator is not None:
            self.speculator.exit()
            self.speculator = None
        if self.model_runner is not None:
            self.model_runner.exit()
            self.model_runner = None
