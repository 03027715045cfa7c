"""build_speculator: the Speculator of a Config's speculative_config (LLMEngine calls it once the
target's KV cache exists: a draft model's cache takes the same number of blocks), with the step
times of the target's runner (and the draft's) measured while their caches hold nothing yet."""
import logging

from nanovllm.config import Config
from nanovllm.executor.abstract import Executor
from nanovllm.spec_decode.cost import measure_step_times
from nanovllm.spec_decode.ngram import NgramProposer
from nanovllm.spec_decode.proposer import Proposer
from nanovllm.spec_decode.speculator import Speculator

logger = logging.getLogger(__name__)


def build_speculator(config: Config, tokenizer, model_runner: Executor, num_kvcache_blocks: int) -> Speculator:
    spec = config.speculative_config
    proposer: Proposer
    # The most rows a verification step has (every sequence that may get proposals, each with k).
    most_seqs = min(config.max_num_seqs, spec.disable_by_batch_size - 1)
    max_rows = min(most_seqs * (1 + spec.num_speculative_tokens), num_kvcache_blocks)
    # The tensor-parallel runner has no single-process forward to time: lengths by the rules alone.
    target_times = measure_step_times(model_runner, max_rows) if model_runner.can_time_steps else None
    draft_times = None
    if spec.method == "ngram":
        proposer = NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)
    else:
        from nanovllm.spec_decode.draft_model import DraftModelProposer
        proposer = DraftModelProposer(config, spec, tokenizer, num_kvcache_blocks)
        draft_times = measure_step_times(proposer.runner, min(2 * most_seqs, num_kvcache_blocks))
    logger.info("speculative decoding: %s, up to %d tokens per step, off at %d or more decoding sequences; "
                "step ms by rows: target %s%s", spec.method, spec.num_speculative_tokens, spec.disable_by_batch_size,
                _ms(target_times), "" if draft_times is None else f", draft {_ms(draft_times)}")
    return Speculator(spec, proposer, target_times, draft_times)


def _ms(times) -> str:
    if times is None:
        return "not measured (tensor parallelism)"
    return " ".join(f"{rows}:{1000 * times.table[rows]:.1f}" for rows in times.rows)
