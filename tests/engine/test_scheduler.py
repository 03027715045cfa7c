"""Scheduler: prefill budget, chunking, decode, preemption order, finishing. No model involved."""
from types import SimpleNamespace

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

BS = 4


def make_scheduler(num_blocks=16, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                   prefix_caching=True) -> Scheduler:
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, eos_token_ids=frozenset({0}),
                             kvcache_block_size=BS, enable_prefix_caching=prefix_caching,
                             speculative_config=None, enable_lora=False, max_loras=1)
    return Scheduler(config, num_blocks)


def seq_of(n: int, start: int = 1, max_tokens: int = 8, ignore_eos: bool = True) -> Sequence:
    return Sequence(list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))


def run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    finished = s.postprocess(out, [token] * len(out.seqs))
    return out, finished


def test_prefill_respects_token_budget_and_chunks_the_overflow():
    s = make_scheduler(max_num_batched_tokens=10)
    a, b = seq_of(6), seq_of(8, start=20)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert out.is_prefill and out.seqs == [a, b] and out.num_new_tokens == [6, 4]
    s.postprocess(out, [7, 7])
    assert len(a) == 7 and len(b) == 8  # b was mid-prompt: no token appended
    assert b.num_computed_tokens == 4 and s.waiting[0] is b
    out = s.schedule()
    assert out.is_prefill and out.seqs == [b] and out.num_new_tokens == [4]
    s.postprocess(out, [9])
    assert b.completion_token_ids == [9] and b.status == SequenceStatus.RUNNING


def test_long_prompt_is_prefilled_in_chunks():
    s = make_scheduler(max_num_batched_tokens=8, num_blocks=16)
    seq = seq_of(20)
    s.add(seq)
    chunks = []
    while seq.num_completion_tokens == 0:
        out, _ = run_step(s)
        chunks.append(out.num_new_tokens[0])
    assert chunks == [8, 8, 4]


def test_max_num_seqs_limits_running_sequences():
    s = make_scheduler(max_num_seqs=2)
    seqs = [seq_of(3, start=10 * i + 1) for i in range(3)]
    for q in seqs:
        s.add(q)
    out = s.schedule()
    assert out.seqs == seqs[:2]
    s.postprocess(out, [7, 7])
    out = s.schedule()
    assert not out.is_prefill and out.seqs == seqs[:2]  # the third waits for a free slot


def test_decode_after_prefill_one_token_each():
    s = make_scheduler()
    a, b = seq_of(3), seq_of(5, start=30)
    s.add(a)
    s.add(b)
    run_step(s)
    out = s.schedule()
    assert not out.is_prefill and out.seqs == [a, b] and out.num_new_tokens == [1, 1]
    assert a.num_computed_tokens == len(a) - 1


def test_preemption_frees_the_latest_running_sequence():
    # 4 blocks of 4 tokens; two sequences of 8 tokens fill the cache exactly.
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    a, b = seq_of(8), seq_of(8, start=50)
    s.add(a)
    s.add(b)
    run_step(s)
    out = s.schedule()  # both need a 3rd block for position 8: only b can be evicted
    assert out.seqs == [a] and s.num_preemptions == 1
    assert list(s.waiting) == [b] and b.block_table == [] and b.status == SequenceStatus.WAITING
    assert b.num_computed_tokens == 0 and len(b) == 9  # keeps its generated token
    assert b.num_cached_tokens == 0
    s.postprocess(out, [7])


def test_preempted_sequence_re_enters_through_its_cached_blocks():
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    a, b = seq_of(8, max_tokens=2), seq_of(8, start=50, max_tokens=8)
    s.add(a)
    s.add(b)
    run_step(s)
    run_step(s)  # b preempted; a takes b's freed tail block for its 3rd block, then finishes
    assert b.status == SequenceStatus.WAITING and not b.block_table
    out = s.schedule()
    # Hand count: b's first block kept its hash and hits (4 tokens); its second went to a, so 5 of
    # b's 9 tokens are computed again.
    assert out.is_prefill and out.seqs == [b] and out.num_new_tokens == [5]
    assert b.num_cached_tokens == b.num_computed_tokens == 4 and len(b.block_table) == 3


def test_preempted_sequence_is_recomputed_with_its_generated_tokens():
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=64, prefix_caching=False)
    a, b = seq_of(8, max_tokens=2), seq_of(8, start=50, max_tokens=8)
    s.add(a)
    s.add(b)
    run_step(s)
    run_step(s)  # b preempted; a finishes (2 tokens)
    assert a.is_finished and a.finish_reason == "length"
    out = s.schedule()
    assert out.is_prefill and out.seqs == [b] and out.num_new_tokens == [9]


def test_finish_on_eos_unless_ignored_and_blocks_freed():
    s = make_scheduler()
    stops = Sequence([1, 2, 3], SamplingParams(max_tokens=8))
    ignores = Sequence([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    s.add(stops)
    s.add(ignores)
    out = s.schedule()
    finished = s.postprocess(out, [0, 0])
    assert finished == [stops] and stops.finish_reason == "stop"
    assert not ignores.is_finished
    s.finish(ignores, "length")
    assert s.kv_cache_manager.num_free_blocks == 16 and s.is_finished()


def test_max_model_len_ends_generation():
    s = make_scheduler(max_model_len=6)
    seq = seq_of(4, max_tokens=100)
    s.add(seq)
    while not seq.is_finished:
        run_step(s)
    assert len(seq) == 6 and seq.finish_reason == "length"


def test_abort_frees_blocks_wherever_the_request_is():
    s = make_scheduler(max_num_batched_tokens=8)
    running, partial = seq_of(4), seq_of(12, start=40)
    s.add(running)
    s.add(partial)
    run_step(s)  # running prefilled; partial got a first chunk of 4 and holds blocks
    assert partial.block_table
    s.abort(partial)
    s.abort(running)
    assert s.is_finished() and s.kv_cache_manager.num_free_blocks == 16


def test_rows_of_several_tokens_apply_each_as_a_decode_step_would():
    """A verification's row emits several tokens (accepted proposals, then the target's own): each
    is appended in turn, the first with the row's scheduled count and the others with one computed
    position each; a row stops at the token that ends it (EOS here), and its later tokens are
    dropped; after_token can end a row too (a stop string), and what it ends is finished."""
    s = make_scheduler(max_model_len=64)
    a, b, c = seq_of(4), Sequence([30, 31, 32, 33], SamplingParams(max_tokens=8)), seq_of(4, start=40)
    for seq in (a, b, c):
        s.add(seq)
    run_step(s)  # prefill: each has 5 tokens, 4 computed
    out = s.schedule()
    assert not out.is_prefill and out.num_new_tokens == [1, 1, 1]

    def stop_at_third_token_of_c(row: int, seq: Sequence, j: int) -> bool:
        if seq is c and j == 1:
            s.finish(seq, "stop")
            return True
        return False
    finished = s.postprocess(out, [[11, 12, 13], [21, 0, 23], [41, 42, 43]], stop_at_third_token_of_c)
    assert a.completion_token_ids == [7, 11, 12, 13] and a.num_computed_tokens == 4 + 3
    assert b.completion_token_ids == [7, 21, 0] and b.finish_reason == "stop"  # EOS: 23 dropped
    assert c.completion_token_ids == [7, 41, 42] and c.finish_reason == "stop"
    assert finished == [b, c] and list(s.running) == [a]
