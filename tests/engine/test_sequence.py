"""Sequence: token bookkeeping, and what a tensor-parallel worker receives (the pickled wire format)."""
import dataclasses
import pickle

import torch

from nanovllm import LLM
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams


def test_counts():
    seq = Sequence(list(range(20)), SamplingParams(temperature=0.5, max_tokens=3))
    assert len(seq) == 20 and seq.num_prompt_tokens == 20 and seq.num_completion_tokens == 0
    seq.append_token(99)
    assert seq.completion_token_ids == [99] and seq.last_token == 99 and len(seq) == 21
    assert seq.prompt_token_ids == list(range(20))
    assert seq.status == SequenceStatus.WAITING and seq.max_tokens == 3
    assert not hasattr(Sequence, "block_size")  # block math is each engine's KVCacheManager's


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


def test_worker_copy_carries_no_sampling_or_output_state():
    seq = Sequence([1, 2, 3], SamplingParams(temperature=0.7, stop=["x"], logprobs=2))
    seq.block_table = [5]
    copy = pickle.loads(pickle.dumps(seq))
    assert (copy.num_tokens, copy.num_computed_tokens, copy.block_table, copy.token_ids) == (3, 0, [5], [1, 2, 3])
    for name in ("sampling_params", "output_text", "output_logprobs", "seq_id", "status", "max_tokens"):
        assert not hasattr(copy, name), name


def decode_ready(prompt_len: int, num_completion: int, params: SamplingParams | None = None) -> Sequence:
    """A sequence as a decode step sees it: every token but the last one in the cache."""
    seq = Sequence([7] * prompt_len, params)
    for _ in range(num_completion):
        seq.append_token(7)
    seq.num_computed_tokens = len(seq) - 1
    seq.block_table = [3, 1, 4]
    return seq


def test_decode_message_does_not_grow_with_output_or_sampling_params():
    # Token counts 300..3000 all pickle as 2-byte ints, so equal sizes mean nothing else grew.
    plain = decode_ready(300, 1)
    heavy = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=5000, logprobs=5,
                           stop=["a long stop string " * 20, "another one " * 20], stop_token_ids=list(range(50)))
    long = decode_ready(300, 2700, heavy)
    long.output_text = "w " * 2700
    long.output_logprobs = [{i: -1.0 for i in range(5)} for _ in range(2700)]
    size = len(pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL))
    assert len(pickle.dumps(long, protocol=pickle.HIGHEST_PROTOCOL)) == size
    # Hand count of what is left: the class reference, 3 ints, a 3-int block table, framing.
    assert size < 120, size


def assert_same_inputs(a, b) -> None:
    """Two prepare_prefill / prepare_decode results are equal, tensors and Context fields alike."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if dataclasses.is_dataclass(x):
            assert_same_inputs([getattr(x, f.name) for f in dataclasses.fields(x)],
                               [getattr(y, f.name) for f in dataclasses.fields(y)])
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert x == y


def test_worker_copy_builds_the_same_step_inputs(qwen3_gqa):
    """Every step of a run with prefix hits, chunks and preemption: the unpickled step (what a worker
    reads from the channel) gives the runner exactly the original's input tensors."""
    seen = set()
    # 16 KiB per block (2 layers x K/V x 16 tokens x 2 heads x 32 dims x 4 bytes): 10 blocks.
    with LLM(qwen3_gqa, dtype="float32", kv_cache_dtype="float32", kvcache_block_size=16, max_num_seqs=4, max_num_batched_tokens=32,
             cpu_kvcache_bytes=10 * 16384) as llm:
        runner = llm.llm_engine.model_runner
        run = runner.run

        def checked_run(out):
            wire = pickle.loads(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
            if out.is_prefill:
                assert_same_inputs(runner.prepare_prefill(out.seqs, out.num_new_tokens),
                                   runner.prepare_prefill(wire.seqs, wire.num_new_tokens))
                for seq, n in zip(out.seqs, out.num_new_tokens):
                    seen.add("prefix hit" if seq.num_cached_tokens else "prefill")
                    seen.add("chunk" if seq.num_computed_tokens + n < len(seq) else "prompt end")
                    if seq.num_completion_tokens:
                        seen.add("recompute")
            else:
                assert_same_inputs(runner.prepare_decode(out.seqs), runner.prepare_decode(wire.seqs))
                assert all(seq.token_ids is None for seq in wire.seqs)
                seen.add("decode")
            return run(out)

        runner.run = checked_run
        shared = list(range(3, 35))  # two full blocks
        greedy = dict(temperature=0, ignore_eos=True)
        llm.generate([shared + [99]], SamplingParams(max_tokens=8, **greedy), use_tqdm=False)
        batch = [shared + [100, 101], list(range(40, 80)), list(range(150, 162)), list(range(200, 220))]
        llm.generate(batch, SamplingParams(max_tokens=24, stop=["the"], **greedy), use_tqdm=False)
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert seen == {"prefill", "prefix hit", "chunk", "prompt end", "recompute", "decode"}
