"""Draft-model speculation (vLLM's "draft_model"): a smaller model sharing the target's tokenizer,
or a lower-bit file of the target itself, proposes k tokens greedily, one forward per token.

With a tensor-parallel target the draft runs whole, in rank 0's process. Its KV cache lies beside
the target's: as many blocks of the same size, and every sequence's
block table indexes both (the Scheduler's KVCacheManager hands out one block id for both caches), so
prefix-cache hits, preemption and freeing need nothing of their own. The draft computes what the
target computes: each prefill chunk (observe) while it could be used, and at each decode step the
positions it has not yet computed (the target's last token; after a verification that accepted
everything also the last proposal, which the draft never ran; a whole sequence whose prefill it
skipped, at loads where it would not have paid) before it proposes. What the draft holds only
shapes its proposals: the target's verification decides every token.
"""
import logging

import torch

from nanovllm.config import Config
from nanovllm.distributed.parallel import single_rank
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.executor.model_runner import ModelRunner
from nanovllm.spec_decode.config import SpeculativeConfig
from nanovllm.spec_decode.proposer import Proposer

logger = logging.getLogger(__name__)


class DraftRunner(ModelRunner):
    """A ModelRunner whose KV cache holds exactly num_blocks blocks (the target's count). Whole on
    rank 0 when the target is tensor-parallel: built and run as rank 0 of 1 (single_rank)."""

    def __init__(self, config: Config, num_blocks: int):
        self.wanted_blocks = num_blocks
        with single_rank():
            super().__init__(config)
        if self.num_kvcache_blocks != num_blocks:
            raise ValueError(f"the draft model's KV cache holds {self.num_kvcache_blocks} blocks, the target's "
                             f"{num_blocks}: give the draft a max_model_len at least the target's")

    def kv_cache_budget_bytes(self) -> int:
        return self.wanted_blocks * self.kv_block_bytes()

    def split_kv_groups(self) -> bool:
        return False  # its layers read the target's first block table, which holds every block

    def run_model(self, *args):
        with single_rank():
            return super().run_model(*args)


def draft_config(target: Config, spec: SpeculativeConfig) -> Config:
    """The draft's engine settings: the target's, for its own checkpoint and weight format."""
    return Config(spec.model, device=target.device, max_num_seqs=target.max_num_seqs,
                  max_num_batched_tokens=target.max_num_batched_tokens, max_model_len=target.max_model_len,
                  kvcache_block_size=target.kvcache_block_size, kv_cache_dtype=target.kv_cache_dtype,
                  enable_prefix_caching=target.enable_prefix_caching, enforce_eager=target.enforce_eager,
                  quantization=spec.quantization, seed=target.seed, cpu_input_bits=target.cpu_input_bits,
                  cpu_kvcache_bytes=target.cpu_kvcache_bytes)


def check_tokenizers(target_tokenizer, draft_tokenizer, draft_path: str) -> None:
    """ValueError unless both tokenizers give every token the same id (a proposal is a target id)."""
    if target_tokenizer is not None and draft_tokenizer is not None \
            and target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(f"the draft model {draft_path}'s tokenizer gives tokens other ids than the target's: "
                         "a draft must share the target's tokenizer")


class DraftModelProposer(Proposer):
    prior_acceptance = 0.9  # a draft of the same family (or the same model in fewer bits) mostly agrees
    runs_a_model = True

    def __init__(self, target: Config, spec: SpeculativeConfig, target_tokenizer, num_blocks: int):
        config = draft_config(target, spec)
        check_tokenizers(target_tokenizer, config.checkpoint.load_tokenizer(), spec.model)
        self.runner = DraftRunner(config, num_blocks)
        # seq_id -> positions of it the draft's cache holds (valid while the target holds them too)
        self.computed: dict[int, int] = {}

    def observe(self, out: SchedulerOutput) -> None:
        # Only chunks that continue what the draft holds (a first chunk, or the one after the
        # last it computed); a sequence whose earlier chunk was skipped catches up when it proposes.
        rows = [(seq, n) for seq, n in zip(out.seqs, out.num_new_tokens)
                if seq.num_computed_tokens in (seq.num_cached_tokens, self.computed.get(seq.seq_id))]
        if not rows:
            return
        seqs, num_new = [s for s, _ in rows], [n for _, n in rows]
        input_ids, positions, context, _ = self.runner.prepare_prefill(seqs, num_new)
        last = torch.tensor([len(input_ids) - 1])  # logits are not needed: the fewest rows
        self.runner.run_model(input_ids, positions, context, self.runner.to_device(last))
        for seq, n in rows:
            self.computed[seq.seq_id] = seq.num_computed_tokens + n

    def start(self, seq: Sequence) -> int:
        """The first position of seq the draft's cache lacks."""
        return min(self.computed.get(seq.seq_id, 0), seq.num_computed_tokens)

    def pending(self, seqs: list[Sequence]) -> list[int]:
        return [len(seq) - self.start(seq) for seq in seqs]

    def skip(self, out: SchedulerOutput) -> None:
        for seq in out.seqs:
            self.computed.pop(seq.seq_id, None)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(num_tokens) if k > 0]
        # First forward: each active sequence's positions the draft lacks, up to its last token.
        tokens, positions, tables, last_rows = [], [], [], []
        for i in active:
            seq = seqs[i]
            start = self.start(seq)
            tokens += seq.token_ids[start:]
            positions += range(start, len(seq))
            tables += [seq.block_table] * (len(seq) - start)
            last_rows.append(len(tokens) - 1)
        step = 0
        while active:
            logits = self.runner.run_model(*self.runner.prepare_rows(tokens, positions, tables), None)
            picked = logits[last_rows].argmax(dim=-1).tolist()
            for i, t in zip(active, picked):
                drafts[i].append(t)
            step += 1
            active = [i for i in active if num_tokens[i] > step]
            tokens = [drafts[i][-1] for i in active]
            positions = [len(seqs[i]) - 1 + step for i in active]
            tables = [seqs[i].block_table for i in active]
            last_rows = list(range(len(active)))
        for i, seq in enumerate(seqs):
            if num_tokens[i] > 0:  # positions up to the last proposal but one are now in its cache
                self.computed[seq.seq_id] = len(seq) - 1 + num_tokens[i]
        return drafts

    def forget(self, seq: Sequence) -> None:
        self.computed.pop(seq.seq_id, None)

    def exit(self) -> None:
        self.runner.exit()
