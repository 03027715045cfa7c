"""Sampler and SamplingMetadata against plain-torch formulas, HF's logits processors and
chi-square goodness-of-fit tests of the draws (no model involved)."""
import math

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from nanovllm import SamplingParams
from nanovllm.sampling_params import MIN_TEMPERATURE
from nanovllm.engine.sequence import Sequence
from nanovllm.sample import sampler as sampler_module
from nanovllm.sample.sampler import Sampler, apply_min_p, apply_penalties, apply_top_k, apply_top_p
from nanovllm.sample.sampling_metadata import SamplingMetadata, step_seed

CPU = torch.device("cpu")
EOS = 1


def decode_rows(params: list[SamplingParams], prompts=None, outputs=None) -> list[Sequence]:
    """Sequences ready for a decode step, with the given prompt and already generated tokens."""
    seqs = []
    for i, sp in enumerate(params):
        seq = Sequence(prompts[i] if prompts else [3, 4], sp)
        for t in (outputs[i] if outputs else []):
            seq.append_token(t)
        seq.num_computed_tokens = len(seq) - 1
        seqs.append(seq)
    return seqs


def metadata(params, vocab, prompts=None, outputs=None) -> SamplingMetadata:
    seqs = decode_rows(params, prompts, outputs)
    return SamplingMetadata.build(seqs, [1] * len(seqs), vocab, frozenset({EOS}), CPU)


# ---- references ---------------------------------------------------------------------------
def reference_probs(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The truncated, renormalised distribution, written as plainly as possible (vLLM's order:
    temperature, min_p, top_k, top_p), for one row of logits."""
    probs = torch.softmax(logits.double() / temperature, dim=-1).tolist()
    keep = set(range(len(probs)))
    if min_p > 0:
        keep = {i for i in keep if probs[i] >= min_p * max(probs)}
    order = sorted(keep, key=lambda i: -probs[i])
    if top_k > 0:
        order = order[:top_k]
    if top_p < 1:
        total = sum(probs[i] for i in order)
        kept, mass = [], 0.0
        for i in order:
            kept.append(i)
            mass += probs[i] / total
            if mass >= top_p:
                break
        order = kept
    out = torch.zeros(len(probs), dtype=torch.float64)
    for i in order:
        out[i] = probs[i]
    return out / out.sum()


def chi_square_passes(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson's chi-square at significance 1e-4 (Wilson-Hilferty critical value); also asserts
    that nothing outside the support was drawn."""
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the kept set: {counts[~support]}"
    expected = counts.sum() * probs[support]
    assert expected.min() >= 5, "test design: too few expected draws per token"
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    z = 3.719  # one-sided normal quantile for 1e-4
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < critical


def reference_penalties(logits, prompt, output, rep, presence, frequency):
    out = logits.clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= presence + frequency * output.count(t)
    return out


# ---- greedy ------------------------------------------------------------------------------
def test_all_greedy_batch_takes_argmax_without_sampling_tensors():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    md = metadata([SamplingParams(temperature=0)] * 6, 50)
    assert md.all_greedy and md.temperatures is None and md.top_k is None
    assert torch.equal(Sampler()(logits, md).token_ids, logits.argmax(-1))


def test_metadata_from_temperatures_alone():
    torch.manual_seed(10)
    logits = torch.randn(6, 50)
    temps = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.7, 0.0])
    md = SamplingMetadata.from_temperatures(temps)
    out = Sampler()(logits, md).token_ids
    assert torch.equal(out[temps == 0], logits.argmax(-1)[temps == 0])
    assert md.temperatures.tolist() == pytest.approx([1.0, 1.0, 1.0, 1.0, 0.7, 1.0])
    assert SamplingMetadata.from_temperatures(torch.zeros(3)).all_greedy


def test_top_k_1_and_tiny_top_p_equal_greedy_in_a_mixed_batch():
    torch.manual_seed(1)
    logits = torch.randn(9, 300) * 3
    params = [SamplingParams(temperature=1.3, top_k=1), SamplingParams(temperature=0.7, top_p=1e-6),
              SamplingParams(temperature=0)] * 3
    for _ in range(5):
        assert torch.equal(Sampler()(logits, metadata(params, 300)).token_ids, logits.argmax(-1))


# ---- truncation masks vs HF --------------------------------------------------------------
def test_masks_match_hf_warpers_row_by_row():
    torch.manual_seed(2)
    vocab = 200
    logits = torch.randn(4, vocab) * 2
    ks, ps, mins = [1, 7, 50, vocab], [0.05, 0.5, 0.9, 0.999], [0.01, 0.1, 0.5, 0.9]
    got_k = apply_top_k(logits, torch.tensor(ks))
    got_p = apply_top_p(logits, torch.tensor(ps))
    got_min = apply_min_p(logits, torch.tensor(mins))
    for i in range(4):
        row = logits[i: i + 1]
        assert torch.equal(got_k[i], TopKLogitsWarper(ks[i])(None, row.clone())[0])
        assert torch.equal(got_p[i], TopPLogitsWarper(ps[i])(None, row.clone())[0])
        assert torch.equal(got_min[i], MinPLogitsWarper(mins[i])(None, row.clone())[0])


def test_top_k_only_batch_with_rows_off_uses_a_partial_top_k():
    torch.manual_seed(9)
    vocab = 100
    logits = torch.randn(4, vocab)
    params = [SamplingParams(top_k=3), SamplingParams(), SamplingParams(top_k=500), SamplingParams(top_k=10)]
    md = metadata(params, vocab)
    assert md.top_p is None and md.max_top_k == 10
    for k_max in (md.max_top_k, None):  # from the metadata, or found on the device
        got = apply_top_k(logits, md.top_k, k_max)
        for i, k in enumerate([3, vocab, vocab, 10]):
            assert torch.equal(got[i], TopKLogitsWarper(k)(None, logits[i: i + 1].clone())[0])


def test_top_p_keeps_the_token_that_crosses_p():
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    kept = lambda p: (apply_top_p(logits, torch.tensor([p]))[0] > float("-inf")).tolist()
    assert kept(0.6) == [True, True, False]    # 0.5 < 0.6, so 0.3 joins and crosses it
    assert kept(0.75) == [True, True, False]   # 0.8 reaches 0.75
    assert kept(0.85) == [True, True, True]
    assert kept(0.1) == [True, False, False]


def test_top_k_then_top_p_matches_the_reference():
    torch.manual_seed(3)
    logits = torch.randn(3, 40)
    ks, ps = [5, 40, 12], [0.7, 0.3, float("inf")]  # 40: top_k off; inf: top_p off
    got = apply_top_p(apply_top_k(logits, torch.tensor(ks)), torch.tensor(ps))
    for i in range(3):
        ref = reference_probs(logits[i], top_k=ks[i] % 40, top_p=min(ps[i], 1.0))
        assert torch.equal(got[i] > float("-inf"), ref > 0)


@pytest.mark.parametrize("candidates", [1024, 8])
def test_top_p_falls_back_to_a_full_sort_when_the_candidates_hold_too_little(monkeypatch, candidates):
    """A flat row needs more than the candidate tokens to reach p; a peaked one does not."""
    monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", candidates)
    torch.manual_seed(11)
    vocab = 3000
    logits = torch.randn(4, vocab) * 0.1
    logits[1, :5] += 12.0  # peaked: five tokens hold almost everything
    ps = [0.9, 0.95, float("inf"), 0.5]
    got = apply_top_p(logits, torch.tensor(ps))
    assert torch.equal(got[2], logits[2])
    for i in (0, 1, 3):
        assert torch.equal(got[i], TopPLogitsWarper(ps[i])(None, logits[i: i + 1].clone())[0])
    assert int((got[0] > float("-inf")).sum()) > 1024  # the flat row really needed the fallback


# ---- penalties ---------------------------------------------------------------------------
def test_penalties_follow_the_formulas_and_hf():
    torch.manual_seed(4)
    vocab = 30
    logits = torch.randn(3, vocab) * 2
    prompts = [[2, 5, 5, 9], [7, 8], [3, 4]]
    outputs = [[5, 11, 11, 11, 20], [8, 8, 13], [6, 6]]
    params = [SamplingParams(repetition_penalty=1.7, presence_penalty=0.4, frequency_penalty=0.3),
              SamplingParams(temperature=0, repetition_penalty=0.8, frequency_penalty=-1.5),
              SamplingParams()]  # no penalties: unchanged
    md = metadata(params, vocab, prompts, outputs)
    got = apply_penalties(logits, md)
    for i, sp in enumerate(params):
        ref = reference_penalties(logits[i], prompts[i], outputs[i], sp.repetition_penalty,
                                  sp.presence_penalty, sp.frequency_penalty)
        torch.testing.assert_close(got[i], ref, rtol=0, atol=1e-6)
    # HF's repetition penalty alone, over prompt + output ids, for a repetition-only row.
    md = metadata([SamplingParams(repetition_penalty=1.7)], vocab, prompts[:1], outputs[:1])
    hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompts[0] + outputs[0]]), logits[:1].clone())
    torch.testing.assert_close(apply_penalties(logits[:1], md), hf, rtol=0, atol=1e-6)


def test_penalties_steer_greedy():
    logits = torch.zeros(1, 10)
    logits[0, 4], logits[0, 6] = 2.0, 1.9
    md = metadata([SamplingParams(temperature=0, presence_penalty=0.5)], 10, outputs=[[4]])
    assert Sampler()(logits, md).token_ids.item() == 6


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(4, 10)
    logits[:, EOS], logits[:, 5], logits[:, 7] = 3.0, 2.0, 1.0
    sp = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5])
    params = [sp, sp, SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5], ignore_eos=True),
              SamplingParams(temperature=0)]
    md = metadata(params, 10, outputs=[[8], [8, 8, 8], [8], []])
    assert Sampler()(logits, md).token_ids.tolist() == [7, EOS, EOS, EOS]


# ---- seeds and chunked rows --------------------------------------------------------------
def test_seeded_rows_ignore_their_batch_companions():
    torch.manual_seed(5)
    vocab = 1000
    target = torch.zeros(vocab)  # uniform: any draw is as likely as any other
    seeded = SamplingParams(seed=1234)
    for step in range(8):
        draws = []
        for companions in (0, 3, 7):
            logits = torch.randn(companions + 1, vocab)
            logits[companions] = target
            params = [SamplingParams(seed=companions + 9)] * companions + [seeded]
            outs = [[0] * step] * (companions + 1)
            draws.append(Sampler()(logits, metadata(params, vocab, outputs=outs)).token_ids[-1].item())
        assert len(set(draws)) == 1
    firsts = {Sampler()(target[None], metadata([seeded], vocab, outputs=[[0] * s])).token_ids.item()
              for s in range(8)}
    assert len(firsts) > 4  # each step draws afresh
    assert step_seed(1234, 0) != step_seed(1234, 1) != step_seed(1235, 0)


def test_mid_prompt_chunk_rows_are_not_sampled():
    sp = SamplingParams(seed=3, logprobs=2, min_tokens=2, repetition_penalty=1.5)
    chunked = Sequence(list(range(10, 30)), sp)   # 20-token prompt, computing 8 of it
    last = Sequence(list(range(10, 30)), sp)      # computing its last 8 tokens
    last.num_computed_tokens = 12
    md = SamplingMetadata.build([chunked, last], [8, 8], 64, frozenset({EOS}), CPU)
    assert md.is_sampled == [False, True]
    assert list(md.generators) == [1] and md.is_greedy.tolist() == [True, False]
    assert md.num_logprobs == [None, 2] and md.banned_rows.tolist() == [1]
    assert md.repetition_penalties.tolist() == [1.0, 1.5]


# ---- distributions -----------------------------------------------------------------------
CASES = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=4),
    dict(temperature=1.3, top_p=0.6),
    dict(temperature=0.9, min_p=0.25),
    dict(temperature=1.1, min_p=0.05, top_k=6, top_p=0.8),
]


def test_draws_follow_the_truncated_distribution():
    """All cases share one batch, so each row's options are applied to that row only."""
    torch.manual_seed(6)
    vocab, per_case = 12, 6000
    base = torch.linspace(2.0, -1.0, vocab)[torch.randperm(vocab)]
    params = [SamplingParams(**case) for case in CASES for _ in range(per_case)]
    logits = base.expand(len(params), vocab).contiguous()
    tokens = Sampler()(logits, metadata(params, vocab)).token_ids
    for i, case in enumerate(CASES):
        counts = torch.bincount(tokens[i * per_case: (i + 1) * per_case], minlength=vocab).double()
        probs = reference_probs(base, **case)
        assert chi_square_passes(counts, probs), (case, counts, probs * per_case)


def test_chi_square_check_rejects_a_wrong_distribution():
    torch.manual_seed(7)
    vocab = 12
    base = torch.linspace(2.0, -1.0, vocab)
    md = metadata([SamplingParams(top_k=4)] * 6000, vocab)
    counts = torch.bincount(Sampler()(base.expand(6000, vocab), md).token_ids, minlength=vocab).double()
    assert not chi_square_passes(counts, reference_probs(base, top_k=4, temperature=0.8))
    with pytest.raises(AssertionError, match="outside the kept set"):
        chi_square_passes(counts, reference_probs(base, top_k=3))


# ---- logprobs ----------------------------------------------------------------------------
def test_logprobs_are_of_the_raw_logits():
    torch.manual_seed(8)
    vocab = 64
    logits = torch.randn(3, vocab) * 2
    params = [SamplingParams(temperature=0.5, logprobs=3, repetition_penalty=2.0),
              SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=0)]
    md = metadata(params, vocab, outputs=[[1, 2, 3]] * 3)
    out = Sampler()(logits, md)
    raw = torch.log_softmax(logits, -1)
    tokens = out.token_ids.tolist()
    rows = out.to_host(md).logprobs
    assert rows[1] is None and rows[2] == {tokens[2]: pytest.approx(raw[2].max().item())}
    first = rows[0]
    assert next(iter(first)) == tokens[0]
    top3 = raw[0].topk(3).indices.tolist()
    assert set(first) == {tokens[0], *top3}
    for t, lp in first.items():
        assert lp == pytest.approx(raw[0, t].item(), abs=1e-6)


@pytest.mark.parametrize("draw", [sampler_module.inverse_cdf_sample, sampler_module.exponential_race_sample])
def test_extreme_repetition_penalties_stay_in_the_vocabulary(draw):
    """Found by schemathesis: repetition_penalty=5e-324 divided positive logits into inf, softmax
    made NaN and the draw an id past the vocabulary, which failed the whole engine step. Now the
    penalized logits stay finite: a tiny penalty makes the seen positive tokens (2 and 5) the only
    likely ones; a huge one on an all-seen, all-negative row leaves a uniform, valid draw."""
    vocab = 8
    logits = torch.tensor([[-1.0, -2.0, 3.0, -0.5, -4.0, 2.0, -3.0, -1.5]])
    tiny = SamplingParams(repetition_penalty=5e-324, temperature=1.0, seed=0, max_tokens=4)
    huge = SamplingParams(repetition_penalty=1e300, temperature=MIN_TEMPERATURE, seed=1, max_tokens=4)
    md = metadata([tiny, huge], vocab, prompts=[[2, 5], list(range(vocab))])
    both = torch.cat([logits, -logits.abs()])
    sampler = Sampler(random_sample=draw)
    for _ in range(20):
        token_ids = sampler(both, md).token_ids.tolist()
        assert token_ids[0] in (2, 5) and 0 <= token_ids[1] < vocab
