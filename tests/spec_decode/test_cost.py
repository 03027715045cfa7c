"""The proposal length that pays (spec_decode/cost.py), against hand-computed tokens per second,
and the engine with step times that make every proposal a loss (no proposals) or a gain."""
import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.spec_decode import build
from nanovllm.spec_decode.cost import AcceptanceRates, StepTimes, best_length, expected_tokens

LINEAR = StepTimes.linear(6.0, 2.0)  # 6 + 2 * rows (ms)


def test_expected_tokens_and_acceptance_rates():
    assert expected_tokens(3, 0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    rates = AcceptanceRates(0.9)
    assert rates.rate(1) == pytest.approx(0.9)  # the prior: 1.8 successes in 2 trials
    rates.record(1, drafted=4, accepted=0)  # 1 trial, rejected
    assert rates.rate(1) == pytest.approx(1.8 / 3)
    rates.record(1, drafted=4, accepted=1)  # 2 trials (the rejected one counts), 1 success
    assert rates.rate(1) == pytest.approx((1 + 1.8) / (0.8 * 1 + 2 + 2))
    for _ in range(30):  # steps without proposals: back towards the prior
        rates.record(1, drafted=0, accepted=0)
    assert rates.rate(1) == pytest.approx(0.9, abs=0.01)
    rates.forget(1)
    assert rates.rate(1) == pytest.approx(0.9)


def test_step_times_between_and_past_the_table():
    times = StepTimes({1: 10.0, 4: 12.0, 8: 20.0})
    assert times(4) == 12.0 and times(0) == 0.0
    assert times(5) == 20.0  # between measured counts: the larger
    assert times(12) == pytest.approx(28.0)  # past the table: the last slope, 2 per row


@pytest.mark.parametrize("caps, rates, draft, want", [
    # One sequence, a = 0.8: L = 0..4 give 1/8, 1.8/10, 2.44/12, 2.952/14 (best), 3.3616/16 tokens per ms.
    ([4], [0.8], None, 3),
    # Eight, a = 0.8: 8/22 < 14.4/38 (L = 1) > 19.52/54 (L = 2).
    ([4] * 8, [0.8] * 8, None, 1),
    # Eight, a = 0.5: 12/38 < 8/22: no proposals.
    ([4] * 8, [0.5] * 8, None, 0),
    # A sequence's own cap bounds it: L = 1 is all it may get.
    ([1], [0.9], None, 1),
    # A draft costing 4 + rows ms per step: 1.9/16, 2.71/23, 3.439/30 all below 1/8.
    ([4], [0.9], StepTimes.linear(4.0, 1.0), 0),
    # A cheap draft (1 + rows / 2): 1.9/12, 2.71/15.5, 3.439/19, 4.0951/22.5 (best).
    ([4], [0.9], StepTimes.linear(1.0, 0.5), 4),
])
def test_best_length_by_hand(caps, rates, draft, want):
    assert best_length(caps, rates, LINEAR, draft) == want


def test_a_draft_cache_to_catch_up_counts():
    """The cheap draft of the last case, but 40 positions of the sequence to compute first: its
    first step costs 1 + 20 ms, and L = 1 gives 1.9 tokens in 10 + 21 ms, L = 4 4.0951 in 16 + 21 + 4.5."""
    cheap = StepTimes.linear(1.0, 0.5)
    assert best_length([4], [0.9], LINEAR, cheap, pending=[2]) == 4
    assert best_length([4], [0.9], LINEAR, cheap, pending=[40]) == 0


def test_rows_for_free_and_rows_that_cost_everything():
    assert best_length([4, 2, 3], [0.5, 0.5, 0.5], StepTimes.linear(1.0, 0.0), None) == 4
    assert best_length([4, 2, 3], [0.99] * 3, StepTimes.linear(0.0, 1.0), None) == 0


def test_measured_on_the_engine_and_used(qwen3_gqa, monkeypatch):
    config = dict(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1)
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 8]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    engine = dict(dtype="float32", kv_cache_dtype="float32", kvcache_block_size=16, max_model_len=128, max_num_seqs=2)
    with LLM(qwen3_gqa, speculative_config=config, **engine) as llm:
        times = llm.llm_engine.speculator.target_times
        assert times.rows == [1, 2, 3, 4, 5, 6, 8]  # up to 2 sequences x (1 + 4) rows
        assert all(t > 0 for t in times.table.values())
        want = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    # Rows that cost more than any token earns: nothing proposed, outputs unchanged.
    monkeypatch.setattr(build, "measure_step_times", lambda runner, max_rows: StepTimes.linear(0.0, 1.0))
    with LLM(qwen3_gqa, speculative_config=config, **engine) as llm:
        assert [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] == want
        assert llm.llm_engine.speculator.metrics.num_drafts == 0
    # Rows almost free next to the step: full lengths.
    monkeypatch.setattr(build, "measure_step_times", lambda runner, max_rows: StepTimes.linear(100.0, 1.0))
    with LLM(qwen3_gqa, speculative_config=config, **engine) as llm:
        assert [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] == want
        assert llm.llm_engine.speculator.metrics.num_accepted_tokens > 0


def test_a_draft_skips_prefills_it_would_not_pay_for_and_catches_up(qwen3_gqa, monkeypatch):
    """Eight sequences starting together, and a draft step costing more than it earns there (draft
    4 + rows / 20 ms against LINEAR: L = 1 gives 15.2 tokens in 38 + 4.8 ms, below 8 in 22): the
    draft skips their prefill. Then its steps become free (as if the batch had shrunk): it proposes,
    first computing each whole sequence. The draft is the target itself: every proposal is accepted
    only if that catch-up filled its cache right."""
    from nanovllm.spec_decode.draft_model import DraftRunner

    def times(runner, max_rows):
        return StepTimes.linear(4.0, 0.05) if isinstance(runner, DraftRunner) else LINEAR
    monkeypatch.setattr(build, "measure_step_times", times)
    prompts = [[5 + i, 6, 7, 8, 9 + i] * 5 for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = dict(dtype="float32", kv_cache_dtype="float32", kvcache_block_size=16, max_model_len=128)
    with LLM(qwen3_gqa, **engine) as llm:
        want = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    config = dict(method="draft_model", model=qwen3_gqa, num_speculative_tokens=4)
    with LLM(qwen3_gqa, speculative_config=config, **engine) as llm:
        speculator, skipped = llm.llm_engine.speculator, []
        real_skip = speculator.proposer.skip
        monkeypatch.setattr(speculator.proposer, "observe", lambda out: pytest.fail("observed a prefill"))

        def skip(out):
            skipped.append(len(out.seqs))
            real_skip(out)
            speculator.draft_times = StepTimes.linear(0.0, 0.0)
        monkeypatch.setattr(speculator.proposer, "skip", skip)
        assert [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] == want
        metrics = speculator.metrics
        assert skipped == [8]  # the one prefill step (all eight prompts)
        assert metrics.num_drafts > 0 and metrics.num_accepted_tokens == metrics.num_draft_tokens
