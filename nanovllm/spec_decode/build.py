"""build_speculator: the Speculator of a Config's speculative_config (LLMEngine calls it once the
target's KV cache exists: a draft model's cache takes the same number of blocks)."""
import logging

from nanovllm.config import Config
from nanovllm.spec_decode.ngram import NgramProposer
from nanovllm.spec_decode.proposer import Proposer
from nanovllm.spec_decode.speculator import Speculator

logger = logging.getLogger(__name__)


def build_speculator(config: Config, tokenizer, num_kvcache_blocks: int) -> Speculator:
    spec = config.speculative_config
    proposer: Proposer
    if spec.method == "ngram":
        proposer = NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)
    else:
        from nanovllm.spec_decode.draft_model import DraftModelProposer
        proposer = DraftModelProposer(config, spec, tokenizer, num_kvcache_blocks)
    logger.info("speculative decoding: %s, up to %d tokens per step, off at %d or more decoding sequences",
                spec.method, spec.num_speculative_tokens, spec.disable_by_batch_size)
    return Speculator(spec, proposer)
