"""Sequence: token bookkeeping, block arithmetic, and what a tensor-parallel worker receives."""
import pickle

from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams


def test_counts_and_blocks():
    seq = Sequence(list(range(20)), SamplingParams(temperature=0.5, max_tokens=3))
    assert len(seq) == 20 and seq.num_prompt_tokens == 20 and seq.num_completion_tokens == 0
    assert seq.num_blocks == 2 and seq.last_block_num_tokens == 4  # block_size 16
    assert seq.block(1) == list(range(16, 20))
    seq.append_token(99)
    assert seq.completion_token_ids == [99] and seq.last_token == 99 and len(seq) == 21
    assert seq.prompt_token_ids == list(range(20))
    assert seq.status == SequenceStatus.WAITING and seq.temperature == 0.5 and seq.max_tokens == 3


def test_ids_are_unique():
    assert Sequence([1]).seq_id != Sequence([1]).seq_id


def test_uncomputed_token_ids_follow_progress():
    seq = Sequence(list(range(10)))
    seq.num_computed_tokens = 4
    assert seq.uncomputed_token_ids(3) == [4, 5, 6]


def test_pickle_ships_whole_prompt_until_decode_ready():
    seq = Sequence(list(range(10)))
    assert pickle.loads(pickle.dumps(seq)).token_ids == list(range(10))
    seq.num_computed_tokens = 10
    seq.append_token(42)  # now decode-ready: only the last token is needed
    copy = pickle.loads(pickle.dumps(seq))
    assert copy.token_ids is None and copy.last_token == 42 and len(copy) == 11
    assert copy.uncomputed_token_ids(1) == [42]
    assert seq.token_ids[-1] == 42  # the original is untouched


def test_reset_for_recompute_keeps_tokens():
    seq = Sequence([1, 2, 3])
    seq.block_table = [4]
    seq.num_computed_tokens = seq.num_cached_tokens = 3
    seq.append_token(5)
    seq.reset_for_recompute()
    assert seq.token_ids == [1, 2, 3, 5] and seq.block_table == [] and seq.num_computed_tokens == 0
