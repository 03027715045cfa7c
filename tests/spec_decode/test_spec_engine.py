"""Speculative decoding end to end on tiny random models: greedy outputs are token-identical with
and without speculation, for every method (n-gram lookup; a draft model that is the target itself,
so everything is accepted; a different model sharing the tokenizer, so most is rejected), at batch
1, 8 and 64, with chunked prefill, prefix-cache hits, forced preemption, stop strings, max_tokens,
logprobs, structured outputs, streaming and TP=2; sampled outputs keep the target's distribution
(chi-square against transformers' probabilities) and a seeded request repeats exactly."""
import random
import re

import pytest
import torch

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.spec_decode import verify

from helpers import make_byte_tokenizer, make_qwen3
from tp_workloads import run_mixed_workload

ENGINE = dict(dtype="float32", kv_cache_dtype="float32", kvcache_block_size=16, max_model_len=256,
              max_num_seqs=64, max_num_batched_tokens=1024)
GREEDY = dict(temperature=0.0, ignore_eos=True)
METHODS = ["ngram", "draft_self", "draft_other"]


@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> str:
    """Another random model with the same tokenizer: its proposals are mostly rejected."""
    return make_qwen3(str(tmp_path_factory.mktemp("qwen3_other")), shape="gqa", seed=11)


def spec_config(method: str, target: str, other: str, k: int = 4, **extra) -> dict:
    if method == "ngram":
        return dict(method="ngram", num_speculative_tokens=k, prompt_lookup_max=3, prompt_lookup_min=1, **extra)
    model = target if method == "draft_self" else other
    return dict(method="draft_model", model=model, num_speculative_tokens=k, **extra)


def prompts_of(n: int, seed: int) -> list[list[int]]:
    """Token prompts of 3..60 tokens, half of them with repeated stretches (n-gram material)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2:
            piece = [rng.randrange(3, 256) for _ in range(rng.randrange(3, 9))]
            out.append((piece * 8)[: rng.randrange(6, 60)])
        else:
            out.append([rng.randrange(3, 256) for _ in range(rng.randrange(3, 60))])
    return out


@pytest.fixture(scope="module")
def plain(qwen3_gqa):
    with LLM(qwen3_gqa, **ENGINE) as engine:
        yield engine


@pytest.fixture(scope="module", params=METHODS)
def speculative(request, qwen3_gqa, other_model):
    config = spec_config(request.param, qwen3_gqa, other_model, disable_by_batch_size=128)
    with LLM(qwen3_gqa, speculative_config=config, **ENGINE) as engine:
        yield request.param, engine


def token_ids(results) -> list[list[int]]:
    return [r["token_ids"] for r in results]


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_greedy_is_token_identical(plain, speculative, batch):
    method, llm = speculative
    prompts = prompts_of(batch, seed=batch)
    params = [SamplingParams(max_tokens=random.Random(i).randrange(8, 40), **GREEDY) for i in range(batch)]
    want = token_ids(plain.generate(prompts, params, use_tqdm=False))
    before = llm.llm_engine.speculator.metrics.as_dict()
    got = token_ids(llm.generate(prompts, params, use_tqdm=False))
    assert got == want
    after = llm.llm_engine.speculator.metrics.as_dict()
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert drafted > 0
    if method == "draft_self":
        assert accepted == drafted  # the target proposing for itself: every proposal is its own argmax
    if method == "draft_other" and batch > 1:
        assert accepted < drafted / 2
    # Emitted tokens are one per verification plus the accepted ones, and never past max_tokens.
    assert after["num_emitted_tokens"] - before["num_emitted_tokens"] == \
        accepted + after["num_drafts"] - before["num_drafts"]
    assert llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks == llm.llm_engine.num_kvcache_blocks


def test_max_tokens_stop_strings_and_logprobs(plain, speculative):
    _, llm = speculative
    prompts = prompts_of(6, seed=99)
    base = plain.generate(prompts, SamplingParams(max_tokens=30, **GREEDY), use_tqdm=False)
    params = []
    for i, b in enumerate(base):  # stop strings in the middle of each output's text
        text = b["text"]
        stop = text[len(text) // 2: len(text) // 2 + 3] if len(text) > 6 else None
        params.append(SamplingParams(max_tokens=[1, 2, 3, 5, 17, 30][i], logprobs=3, stop=stop, **GREEDY))
    want = plain.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    for g, w, p in zip(got, want, params):
        assert g["token_ids"] == w["token_ids"]
        assert g["text"] == w["text"]
        assert g["finish_reason"] == w["finish_reason"]
        assert len(g["token_ids"]) <= p.max_tokens
        assert len(g["logprobs"]) == len(w["logprobs"]) == len(g["token_ids"])
        for a, b in zip(g["logprobs"], w["logprobs"]):
            assert list(a) == list(b)
            assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)
    assert any(w["finish_reason"] == "stop" for w in want)


@pytest.mark.parametrize("method", METHODS)
def test_chunked_prefill_prefix_hits_and_preemption(qwen3_gqa, other_model, method):
    want, _, _, _, _ = run_mixed_workload(qwen3_gqa, tp=1)
    got, steps, preempted, _, _ = run_mixed_workload(
        qwen3_gqa, tp=1, speculative_config=spec_config(method, qwen3_gqa, other_model))
    prefills = [seq for is_prefill, seqs in steps if is_prefill for seq in seqs]
    assert any(cached == 32 for cached, *_ in prefills)  # a prefix-cache hit
    assert any(computed + n < length for _, computed, n, length in prefills)  # a chunk
    assert preempted > 0
    assert got == want


@pytest.mark.parametrize("method", ["ngram", "draft_self"])
def test_tp2(qwen3_gqa, other_model, method):
    """The target over two ranks; a draft model whole in rank 0's process (single_rank)."""
    want, _, _, _, _ = run_mixed_workload(qwen3_gqa, tp=1)
    got, _, preempted, _, _ = run_mixed_workload(qwen3_gqa, tp=2,
                                                 speculative_config=spec_config(method, qwen3_gqa, other_model))
    assert preempted > 0
    assert got == want


def test_seeded_requests_repeat_and_n_siblings_differ(speculative):
    _, llm = speculative
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, n=3, max_tokens=24, ignore_eos=True)
    prompts = prompts_of(2, seed=5)
    first = llm.generate(prompts, params, use_tqdm=False)
    llm.generate(prompts_of(3, seed=6), SamplingParams(temperature=1.0, max_tokens=9), use_tqdm=False)
    second = llm.generate(prompts, params, use_tqdm=False)
    assert first == second
    siblings = [c["token_ids"] for c in first[0]["outputs"]]
    assert len(siblings) == 3 and len({tuple(s) for s in siblings}) > 1


def test_streaming_sends_accepted_tokens_at_once(qwen3_gqa, plain):
    config = dict(method="draft_model", model=qwen3_gqa, num_speculative_tokens=4)
    prompts = prompts_of(3, seed=3)
    params = SamplingParams(max_tokens=40, **GREEDY)
    want = token_ids(plain.generate(prompts, params, use_tqdm=False))
    with LLM(qwen3_gqa, speculative_config=config, **ENGINE) as llm:
        deltas = list(llm.generate_stream(prompts, params))
    got = [[] for _ in prompts]
    for d in deltas:
        got[d.request_id] += d.token_ids
    assert got == want
    assert max(len(d.token_ids) for d in deltas) == 5  # four proposals and the target's own in one step
    assert len(deltas) < sum(len(w) for w in want) / 2


def test_no_proposals_at_or_above_disable_by_batch_size(qwen3_gqa, other_model):
    config = spec_config("ngram", qwen3_gqa, other_model, disable_by_batch_size=4)
    prompts = [p for p in prompts_of(8, seed=4) if len(p) > 10][:4]  # repeated stretches: n-gram material
    params = SamplingParams(max_tokens=16, **GREEDY)
    with LLM(qwen3_gqa, speculative_config=config, **ENGINE) as llm:
        llm.generate(prompts, params, use_tqdm=False)  # four decode together to the end
        assert llm.llm_engine.speculator.metrics.num_drafts == 0
        llm.generate(prompts[:3], params, use_tqdm=False)
        assert llm.llm_engine.speculator.metrics.num_drafts > 0


# ---- structured outputs: proposals are checked against the grammar -------------------------------
@pytest.fixture(scope="module")
def byte_model(tmp_path_factory) -> str:
    path = make_qwen3(str(tmp_path_factory.mktemp("qwen3_bytes")), vocab_size=320, seed=3)
    make_byte_tokenizer(path)
    return path


def test_structured_outputs(byte_model):
    regex = r"(ab|cd|ef){4,12}-[0-9]{2,6}"
    prompts = ["hello world", "abab", "the quick brown fox", "cdcdcdcd"]
    greedy = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex))
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(regex=regex))
    engine = dict(ENGINE, max_model_len=128)
    with LLM(byte_model, **engine) as llm:
        want = llm.generate(prompts, greedy, use_tqdm=False)
    config = dict(method="ngram", num_speculative_tokens=4, prompt_lookup_max=2, prompt_lookup_min=1)
    with LLM(byte_model, speculative_config=config, **engine) as llm:
        got = llm.generate(prompts, greedy, use_tqdm=False)
        drawn = llm.generate(prompts, sampled, use_tqdm=False)
        assert llm.llm_engine.speculator.metrics.num_accepted_tokens > 0
    assert token_ids(got) == token_ids(want)
    assert all(re.fullmatch(regex, r["text"]) for r in got + drawn)


# ---- sampling keeps the target's distribution ---------------------------------------------------
TEMPERATURE, TOP_K, NUM_SAMPLES = 1.0, 3, 1500


def chi2_critical(dof: int, z: float = 3.719) -> float:
    """The chi-square value exceeded with probability 1e-4 (z: the normal's 1e-4 upper point), by
    Wilson and Hilferty's cube-root approximation (a few percent above the exact value: 21.8 for
    21.1 at 3 degrees of freedom, 44.6 for 42.6 at 15)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * a ** 0.5) ** 3


def exact_pairs(path: str, prompt: list[int]) -> dict[tuple[int, int], float]:
    """P(2nd, 3rd generated token) under temperature TEMPERATURE and top-k TOP_K, from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def dist(ids: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        top = torch.topk(logits, TOP_K)
        probs = torch.softmax(top.values / TEMPERATURE, dim=-1)
        return dict(zip(top.indices.tolist(), probs.tolist()))

    pairs: dict[tuple[int, int], float] = {}
    for a, pa in dist(prompt).items():
        for b, pb in dist(prompt + [a]).items():
            for c, pc in dist(prompt + [a, b]).items():
                pairs[(b, c)] = pairs.get((b, c), 0.0) + pa * pb * pc
    return pairs


def chi_square(counts: dict, exact: dict, total: int) -> tuple[float, int]:
    """Cells expecting >= 5 samples each, the rest pooled into one; (statistic, degrees of freedom)."""
    big = [cell for cell, p in exact.items() if p * total >= 5]
    observed = [counts.get(cell, 0) for cell in big] + [total - sum(counts.get(cell, 0) for cell in big)]
    expected = [exact[cell] * total for cell in big] + [total * (1 - sum(exact[cell] for cell in big))]
    if expected[-1] < 5:  # nothing worth a pooled cell
        observed[-2] += observed.pop()
        expected[-2] += expected.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return stat, len(observed) - 1


def sampled_pairs(llm: LLM, prompt: list[int]) -> dict[tuple[int, int], int]:
    params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=3, ignore_eos=True)
    out = llm.generate([prompt] * NUM_SAMPLES, params, use_tqdm=False)
    counts: dict[tuple[int, int], int] = {}
    for o in out:
        cell = tuple(o["token_ids"][1:3])
        counts[cell] = counts.get(cell, 0) + 1
    return counts


def test_sampling_keeps_the_target_distribution(qwen3_gqa, monkeypatch):
    """The draft is the target itself (greedy proposals: a point mass on its argmax, accepted with
    probability p(argmax)). A rule that accepts whatever is proposed must fail the same test."""
    prompt = [5, 17, 33, 9, 60, 21]
    exact = exact_pairs(qwen3_gqa, prompt)
    config = dict(method="draft_model", model=qwen3_gqa, num_speculative_tokens=2, disable_by_batch_size=128)
    with LLM(qwen3_gqa, speculative_config=config, **ENGINE) as llm:
        counts = sampled_pairs(llm, prompt)
        metrics = llm.llm_engine.speculator.metrics
        assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens  # both outcomes happened
        stat, dof = chi_square(counts, exact, NUM_SAMPLES)
        assert dof >= 3
        assert stat < chi2_critical(dof), (counts, exact)

        real_accept = verify.accept

        def accept_everything(target, probs, replacement, is_greedy, drafts, uniform, draft_probs=None):
            return real_accept(target, probs, replacement, is_greedy, drafts,
                               None if uniform is None else torch.full_like(uniform, -1.0), draft_probs)
        monkeypatch.setattr(verify, "accept", accept_everything)
        counts = sampled_pairs(llm, prompt)
        stat, dof = chi_square(counts, exact, NUM_SAMPLES)
        assert stat > 3 * chi2_critical(dof)


# ---- other attention backends: the Triton kernels (interpreted here), CUDA graphs on a GPU ---------
def backend_outputs(path: str, speculative_config, **engine) -> tuple[list[list[int]], dict | None]:
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(10, 40)), [9] * 20]
    params = SamplingParams(max_tokens=20, **GREEDY)
    with LLM(path, speculative_config=speculative_config, kvcache_block_size=16, max_model_len=128,
             max_num_seqs=8, **engine) as llm:
        out = token_ids(llm.generate(prompts, params, use_tqdm=False))
        return out, llm.llm_engine.speculator.metrics.as_dict() if llm.llm_engine.speculator else None


def test_triton_backend_verifies_rows(qwen3_gqa):
    """The Triton KV store and paged decode kernels take a sequence's verification rows as decode
    rows over one block table (every row stored before any attends, per layer)."""
    engine = dict(device="cpu", attention_backend="triton", dtype="float32", kv_cache_dtype="float32",
                  cpu_kvcache_bytes=1 << 20)
    want, _ = backend_outputs(qwen3_gqa, None, **engine)
    for config in (dict(method="draft_model", model=qwen3_gqa, num_speculative_tokens=3),
                   dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)):
        got, metrics = backend_outputs(qwen3_gqa, config, **engine)
        assert got == want
        assert metrics["num_accepted_tokens"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cuda_verification_with_and_without_graphs(qwen3_gqa, enforce_eager):
    engine = dict(device="cuda", dtype="float32", enforce_eager=enforce_eager)
    want, _ = backend_outputs(qwen3_gqa, None, **engine)
    got, metrics = backend_outputs(qwen3_gqa, dict(method="draft_model", model=qwen3_gqa, num_speculative_tokens=3),
                                   **engine)
    assert got == want
    assert metrics["num_accepted_tokens"] == metrics["num_draft_tokens"] > 0
