"""Sampling options through the whole engine on a tiny random Qwen3, against HF transformers
(greedy, repetition penalty, min_new_tokens, logprobs) and hand-computed expectations."""
import json
import os
import shutil

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.helpers import hf_greedy, make_qwen3

ENGINE = dict(device="cpu", dtype="float32", kv_cache_dtype="float32", max_model_len=256, max_num_batched_tokens=512, max_num_seqs=8)
P1 = list(range(5, 45))           # 40 tokens: two full 16-token blocks and a partial one
P2 = [60, 61, 62, 63, 64, 65, 66]
P3 = [100, 90, 80, 70]
P4 = list(range(200, 150, -1))    # its greedy continuation has no repeated words


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_qwen3(str(tmp_path_factory.mktemp("qwen3_sampling")))


@pytest.fixture(scope="module")
def llm(model_dir):
    engine = LLM(model_dir, **ENGINE)
    yield engine
    engine.exit()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def greedy(model_dir):
    """HF's greedy tokens and raw logits for P1, P2 and P4, 10 new tokens each."""
    return hf_greedy(model_dir, [P1, P2, P4], 10)


def gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_existing_callers_get_the_old_fields(llm):
    out = gen(llm, [P2], SamplingParams(temperature=0.6, max_tokens=4, ignore_eos=True))[0]
    assert len(out["token_ids"]) == 4 and out["finish_reason"] == "length" and out["stop_reason"] is None
    assert out["text"] == llm.tokenizer.decode(out["token_ids"], skip_special_tokens=True)
    assert "logprobs" not in out and len(out["outputs"]) == 1


def test_greedy_variants_and_their_logprobs_equal_hf(llm, greedy):
    variants = [SamplingParams(temperature=0, max_tokens=10, logprobs=3),
                SamplingParams(temperature=1.0, top_k=1, max_tokens=10, logprobs=3),
                SamplingParams(temperature=0.8, top_p=1e-6, max_tokens=10, logprobs=3)]
    for sp in variants:
        outs = gen(llm, [P1, P2, P4], sp)
        for out, (tokens, logits) in zip(outs, greedy):
            assert out["token_ids"] == tokens, sp
            raw = torch.log_softmax(logits.float(), dim=-1)
            for step, (token, entry) in enumerate(zip(tokens, out["logprobs"])):
                assert next(iter(entry)) == token
                assert set(entry) == set(raw[step].topk(3).indices.tolist())  # greedy: chosen is top-1
                for t, lp in entry.items():
                    assert lp == pytest.approx(raw[step, t].item(), abs=1e-4)


def test_sampled_tokens_logprobs_equal_hf_logits(llm, hf_model):
    sp = SamplingParams(temperature=1.5, top_k=50, seed=3, max_tokens=6, logprobs=2, repetition_penalty=1.3)
    out = gen(llm, [P2], sp)[0]
    tokens = out["token_ids"]
    with torch.no_grad():
        logits = hf_model(torch.tensor([P2 + tokens])).logits[0, len(P2) - 1: -1]
    raw = torch.log_softmax(logits.float(), dim=-1)  # raw: before temperature and penalty
    for step, entry in enumerate(out["logprobs"]):
        assert list(entry)[0] == tokens[step]
        assert set(raw[step].topk(2).indices.tolist()) <= set(entry) and len(entry) <= 3
        for t, lp in entry.items():
            assert lp == pytest.approx(raw[step, t].item(), abs=1e-4)
    expected = sum(raw[i, t].item() for i, t in enumerate(tokens))
    assert out["cumulative_logprob"] == pytest.approx(expected, abs=1e-3)


def test_seed_reproduces_across_runs_companions_and_chunking(llm, model_dir):
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=10)
    alone = gen(llm, [P1], seeded)[0]["token_ids"]
    assert gen(llm, [P1], seeded)[0]["token_ids"] == alone
    other = SamplingParams(temperature=1.2, max_tokens=12, top_p=0.9)
    mixed = gen(llm, [P2, P1, P3], [other, seeded, SamplingParams(temperature=0, max_tokens=3)])
    assert mixed[1]["token_ids"] == alone
    assert gen(llm, [P1], SamplingParams(temperature=1.0, seed=12, max_tokens=10))[0]["token_ids"] != alone
    # Chunked prefill: the 40-token prompt takes three steps; its mid-prompt steps draw nothing.
    chunked = LLM(model_dir, **dict(ENGINE, max_num_batched_tokens=16, max_num_seqs=4))
    try:
        assert gen(chunked, [P3, P1], [other, seeded])[1]["token_ids"] == alone
    finally:
        chunked.exit()


def test_repetition_penalty_matches_hf_generate(llm, hf_model, greedy):
    with torch.no_grad():
        hf = hf_model.generate(torch.tensor([P2]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                               repetition_penalty=1.8, pad_token_id=0)[0, len(P2):].tolist()
    out = gen(llm, [P2], SamplingParams(temperature=0, repetition_penalty=1.8, max_tokens=10, ignore_eos=True))
    assert out[0]["token_ids"] == hf
    assert hf != greedy[1][0]  # the penalty did change the greedy path


def first_prefix_containing(llm, tokens, stop):
    """Hand reference: the fewest tokens whose full decode contains stop, and that decode."""
    for k in range(1, len(tokens) + 1):
        text = llm.tokenizer.decode(tokens[:k], skip_special_tokens=True)
        if stop in text:
            return k, text
    raise AssertionError("stop string not in the output")


def test_stop_strings_spanning_two_tokens(llm, greedy):
    tokens = greedy[2][0]
    words = llm.tokenizer.decode(tokens, skip_special_tokens=True).split(" ")
    stop = words[2][-2:] + " " + words[3][:2]  # ends inside the 4th token, starts in the 3rd
    k, text = first_prefix_containing(llm, tokens, stop)
    cut = text.find(stop)
    for include in (False, True):
        sp = SamplingParams(temperature=0, max_tokens=10, stop=["never-there", stop],
                            include_stop_str_in_output=include)
        out = gen(llm, [P4], sp)[0]
        assert out["token_ids"] == tokens[:k] and out["finish_reason"] == "stop" and out["stop_reason"] == stop
        assert out["text"] == text[: cut + len(stop) * include]


def test_earliest_stop_string_wins_and_min_tokens_delays_it(llm, greedy):
    tokens = greedy[2][0]
    words = llm.tokenizer.decode(tokens, skip_special_tokens=True).split(" ")
    late, early = words[5], " " + words[1]
    out = gen(llm, [P4], SamplingParams(temperature=0, max_tokens=10, stop=[late, early]))[0]
    k, text = first_prefix_containing(llm, tokens, early)
    assert out["stop_reason"] == early and out["token_ids"] == tokens[:k]
    assert out["text"] == text[: text.find(early)]
    out = gen(llm, [P4], SamplingParams(temperature=0, max_tokens=10, stop=[early], min_tokens=k))[0]
    assert out["token_ids"] == tokens and out["finish_reason"] == "length" and out["stop_reason"] is None


def test_stop_token_ids_end_the_output(llm, greedy):
    tokens = greedy[2][0]
    i = next(i for i in range(2, 10) if tokens[i] not in tokens[:i])
    for include in (False, True):
        sp = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[tokens[i]],
                            include_stop_str_in_output=include)
        out = gen(llm, [P4], sp)[0]
        assert out["token_ids"] == tokens[: i + 1]
        assert out["finish_reason"] == "stop" and out["stop_reason"] == tokens[i]
        assert out["text"] == llm.tokenizer.decode(tokens[: i + include], skip_special_tokens=True)


def test_incremental_text_equals_full_decode_with_special_tokens(llm, greedy):
    tokens = greedy[2][0]
    assert {0, 2} & set(tokens)  # the output holds special tokens (<unk>, <bos>)
    for skip in (True, False):
        expected = llm.tokenizer.decode(tokens, skip_special_tokens=skip)
        for stop in (None, ["no such text"]):  # full decode at the end / per-token detokenizing
            sp = SamplingParams(temperature=0, max_tokens=10, skip_special_tokens=skip, stop=stop)
            assert gen(llm, [P4], sp)[0]["text"] == expected


def test_min_tokens_holds_off_eos_like_hf(model_dir, hf_model, greedy, tmp_path):
    tokens = greedy[1][0]
    eos = tokens[2]  # make the model's third greedy token its EOS
    assert eos not in tokens[:2]
    eos_dir = str(tmp_path / "eos_model")
    shutil.copytree(model_dir, eos_dir)
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(eos_dir, name)
        with open(path) as f:
            cfg = json.load(f)
        cfg["eos_token_id"] = eos
        with open(path, "w") as f:
            json.dump(cfg, f)
    engine = LLM(eos_dir, **ENGINE)
    try:
        out = gen(engine, [P2], SamplingParams(temperature=0, max_tokens=10))[0]
        assert out["token_ids"] == tokens[:3] and out["finish_reason"] == "stop" and out["stop_reason"] is None
        assert out["text"] == engine.tokenizer.decode(tokens[:2])  # EOS text left out
        out = gen(engine, [P2], SamplingParams(temperature=0, max_tokens=10, min_tokens=6))[0]
    finally:
        engine.exit()
    with torch.no_grad():
        hf = hf_model.generate(torch.tensor([P2]), max_new_tokens=10, min_new_tokens=6, do_sample=False,
                               eos_token_id=eos, pad_token_id=0)[0, len(P2):].tolist()
    assert out["token_ids"] == hf and eos not in hf[:6] and len(hf) > 3


def test_n_completions_share_the_prompt_blocks(llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6)
    first, *siblings = llm.llm_engine.add_request_group(P1, sp)
    llm.llm_engine.step()  # prefills the first completion only
    assert first.num_completion_tokens == 1 and all(s.num_completion_tokens == 0 for s in siblings)
    llm.llm_engine.step()  # the siblings' prefill: two 16-token blocks come from the prefix cache
    blocks = llm.llm_engine.scheduler.kv_cache_manager.pool.blocks
    for s in siblings:
        assert s.num_cached_tokens == 32 and s.block_table[:2] == first.block_table[:2]
    assert [blocks[b].ref_count for b in first.block_table[:2]] == [3, 3]
    while not llm.llm_engine.is_finished():
        llm.llm_engine.step()
    completions = [llm.llm_engine.output_of(s)["token_ids"] for s in (first, *siblings)]
    assert len(set(map(tuple, completions))) == 3
    # Completion i is the seed + i single completion (vLLM's rule), and generate() groups them.
    out = gen(llm, [P1], sp)[0]
    assert [o["token_ids"] for o in out["outputs"]] == completions
    assert [o["index"] for o in out["outputs"]] == [0, 1, 2]
    assert {k: out[k] for k in ("text", "token_ids", "finish_reason")} == \
        {k: out["outputs"][0][k] for k in ("text", "token_ids", "finish_reason")}
    single = gen(llm, [P1], SamplingParams(temperature=1.0, seed=6, max_tokens=6))[0]
    assert single["token_ids"] == completions[1]


def test_aborting_part_of_a_group_leaves_the_rest_running(llm):
    first, held, other = llm.llm_engine.add_request_group(P2, SamplingParams(n=3, seed=1, max_tokens=4))
    llm.llm_engine.abort_request(held)  # still held back: never scheduled
    llm.llm_engine.abort_request(first)  # its remaining sibling no longer waits for it
    assert held.finish_reason == first.finish_reason == "abort"
    while not llm.llm_engine.is_finished():
        llm.llm_engine.step()
    assert other.finish_reason == "length" and len(llm.llm_engine.output_of(other)["token_ids"]) == 4
    assert llm.llm_engine.output_of(held)["token_ids"] == [] and not llm.llm_engine.output_processor.states


def test_max_tokens_none_runs_to_max_model_len(model_dir):
    engine = LLM(model_dir, **dict(ENGINE, max_model_len=20))
    try:
        out = gen(engine, [P2], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    finally:
        engine.exit()
    assert len(P2) + len(out["token_ids"]) == 20 and out["finish_reason"] == "length"


def test_engine_rejects_bad_requests_without_side_effects(llm):
    with pytest.raises(ValueError, match=r"stop_token_ids \[256\]"):
        gen(llm, [P2, P3], [SamplingParams(), SamplingParams(stop_token_ids=[256])])
    with pytest.raises(ValueError, match="n=2"):
        llm.llm_engine.add_request(P2, SamplingParams(n=2))
    assert llm.llm_engine.is_finished() and not llm.llm_engine.output_processor.states
