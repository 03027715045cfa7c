"""Structured outputs through the engine on a tiny random Qwen3 with a byte-level tokenizer: every
output is in the grammar's language (checked with Python's re / json / jsonschema), and every
sampled token is one a fresh xgrammar matcher accepts, under each sampling option."""
import json
import pickle
import re
import subprocess
import sys
from collections import defaultdict

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from helpers import make_byte_tokenizer, make_qwen3  # noqa: E402
from nanovllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from nanovllm.sample.structured_outputs import GrammarCache, apply_token_bitmask  # noqa: E402

MODEL_VOCAB = 320  # above the tokenizer's 259: the padding ids must never be sampled
ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8, kvcache_block_size=16)
PROMPTS = ["hello world", "the quick brown fox", "1 + 1 =", "tell me a story about the sea"]
REGEX = r"[a-c]{2,5}-\d{1,3}"
CHOICES = ["yes", "no", "maybe not"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "color", "n"],
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"type": "string", "pattern": "^[a-z]{0,4}$"}}}


def constrained(**kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_qwen3(str(tmp_path_factory.mktemp("qwen3_bytes")), vocab_size=MODEL_VOCAB, seed=3)
    make_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, **ENGINE) as engine:
        yield engine


def completions(results: list[dict]) -> list[dict]:
    return [c for r in results for c in r["outputs"]]


def replay(llm, params: StructuredOutputsParams, token_ids: list[int]) -> bool:
    """Whether a fresh matcher, compiled here independently of the engine, accepts every token
    and ends at the last one (EOS)."""
    info = xgr.TokenizerInfo.from_huggingface(llm.tokenizer, vocab_size=MODEL_VOCAB, stop_token_ids=[1])
    compiler = xgr.GrammarCompiler(info)
    kind = params.kind
    compiled = {"regex": lambda: compiler.compile_regex(params.regex),
                "json": lambda: compiler.compile_json_schema(params.json, any_whitespace=False),
                "json_object": lambda: compiler.compile_json_schema({"type": "object"}, any_whitespace=False),
                "grammar": lambda: compiler.compile_grammar(params.grammar)}[kind]()
    matcher = xgr.GrammarMatcher(compiled)
    return all(matcher.accept_token(t) for t in token_ids) and matcher.is_terminated()


SAMPLINGS = [dict(temperature=0), dict(temperature=1.0, seed=7), dict(temperature=1.5, top_k=20, top_p=0.9),
             dict(temperature=0.8, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5)]


@pytest.mark.parametrize("options", SAMPLINGS, ids=["greedy", "seeded", "top_k_p", "min_p_penalties"])
def test_regex_and_choice_hold_under_every_sampling_option(llm, options):
    regex = constrained(regex=REGEX)
    out = completions(llm.generate(PROMPTS, SamplingParams(max_tokens=32, n=2, structured_outputs=regex, **options),
                                   use_tqdm=False))
    for c in out:
        assert re.fullmatch(REGEX, c["text"]), c["text"]
        assert c["finish_reason"] == "stop" and c["token_ids"][-1] == 1  # ended on EOS, text without it
        assert replay(llm, regex, c["token_ids"])
    out = completions(llm.generate(PROMPTS, SamplingParams(max_tokens=16, n=2, **options,
                                                           structured_outputs=constrained(choice=CHOICES)),
                                   use_tqdm=False))
    assert all(c["text"] in CHOICES and c["finish_reason"] == "stop" for c in out)


def test_the_mask_does_the_work(llm):
    # Unconstrained, this random model writes byte soup, and padding ids beyond the tokenizer's.
    free = completions(llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=1, max_tokens=32), use_tqdm=False))
    assert not any(re.fullmatch(REGEX, c["text"] or "") for c in free)
    kept = completions(llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=1, max_tokens=32, n=4,
                                                            structured_outputs=constrained(regex=REGEX)),
                                    use_tqdm=False))
    assert all(t < 259 for c in kept for t in c["token_ids"])
    assert len({c["text"] for c in kept}) > 4  # siblings walk the grammar each on their own


def test_json_schema_json_object_and_grammar(llm):
    jsonschema = pytest.importorskip("jsonschema")
    schema = constrained(json=SCHEMA)
    for c in completions(llm.generate(PROMPTS, SamplingParams(temperature=1.0, n=2, max_tokens=64,
                                                              structured_outputs=schema), use_tqdm=False)):
        jsonschema.validate(json.loads(c["text"]), SCHEMA)
        assert replay(llm, schema, c["token_ids"])
    grammar = constrained(grammar='root ::= [0-9] [0-9]? ("!" | "?")')
    for c in completions(llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=8,
                                                              structured_outputs=grammar), use_tqdm=False)):
        assert re.fullmatch(r"[0-9]{1,2}[!?]", c["text"]) and replay(llm, grammar, c["token_ids"])
    # Any JSON: a random model may write an endless string, so check what was written is a JSON prefix.
    obj = constrained(json_object=True)
    for c in completions(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24,
                                                              structured_outputs=obj), use_tqdm=False)):
        assert c["text"].startswith("{")
        if c["finish_reason"] == "stop":
            assert isinstance(json.loads(c["text"]), dict) and replay(llm, obj, c["token_ids"])


def test_stop_string_and_streaming(llm):
    choice = constrained(choice=["alpha beta", "gamma delta"])
    out = completions(llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=3, n=2, stop=" ",
                                                           structured_outputs=choice), use_tqdm=False))
    assert all(c["text"] in ("alpha", "gamma") and c["stop_reason"] == " " for c in out)
    sp = SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=32, structured_outputs=constrained(regex=REGEX))
    pieces, finish = defaultdict(str), {}
    for delta in llm.generate_stream(PROMPTS, sp):
        pieces[delta.request_id, delta.index] += delta.text
        if delta.finish_reason is not None:
            finish[delta.request_id, delta.index] = delta.finish_reason
    offline = llm.generate(PROMPTS, sp, use_tqdm=False)
    for (i, index), text in pieces.items():
        assert text == offline[i]["outputs"][index]["text"] and re.fullmatch(REGEX, text)
        assert finish[i, index] == "stop"


def test_logprobs_stay_raw(llm):
    """The grammar narrows the choice, not the reported distribution: the first token's top
    logprobs equal the unconstrained run's, and the chosen token's logprob is the raw one."""
    free = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)[0]
    kept = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, logprobs=5,
                                                    structured_outputs=constrained(choice=["zz"])),
                        use_tqdm=False)[0]
    assert kept["text"] == "zz"
    first, reference = kept["logprobs"][0], free["logprobs"][0]
    z = kept["token_ids"][0]
    assert z not in reference  # the grammar's token was not among the model's favourites
    assert {t: v for t, v in first.items() if t != z} == pytest.approx(dict(list(reference.items())[:5]))
    assert first[z] < min(reference.values())


def test_preemption_keeps_the_grammar_state(model_dir, llm):
    regex = constrained(regex=r"[a-z]{30,40}")
    sp = SamplingParams(temperature=0, max_tokens=48, structured_outputs=regex)
    prompts = [f"prompt number {i} says" for i in range(8)]
    expected = llm.generate(prompts, sp, use_tqdm=False)
    with LLM(model_dir, **dict(ENGINE, cpu_kvcache_bytes=12 * 16 * 1024)) as small:
        got = small.generate(prompts, sp, use_tqdm=False)
        assert small.llm_engine.scheduler.num_preemptions > 0
    assert [g["token_ids"] for g in got] == [e["token_ids"] for e in expected]
    assert all(re.fullmatch(r"[a-z]{30,40}", g["text"]) for g in got)


def test_grammar_decides_the_end(llm):
    # ignore_eos cannot push past the grammar's end, and min_tokens cannot hold it back.
    for sp in (SamplingParams(ignore_eos=True, max_tokens=20), SamplingParams(min_tokens=10, max_tokens=20)):
        sp.structured_outputs = constrained(choice=["no"])
        out = llm.generate(PROMPTS, sp, use_tqdm=False)
        assert all(o["text"] == "no" and o["finish_reason"] == "stop" for o in out)


@pytest.mark.parametrize("kwargs, words", [
    ({"regex": "(ab"}, "structured_outputs.regex is not a valid regex"),
    ({"json": {"type": "nonsense"}}, "structured_outputs.json is not a valid JSON schema"),
    ({"grammar": "root ::= missing"}, "structured_outputs.grammar is not a valid grammar"),
])
def test_bad_spec_is_refused_before_queueing(llm, kwargs, words):
    sp = SamplingParams(structured_outputs=constrained(**kwargs))
    with pytest.raises(ValueError, match=words):
        llm.generate(PROMPTS, [SamplingParams(), sp, SamplingParams(), SamplingParams()], use_tqdm=False)
    assert llm.llm_engine.is_finished()


def test_compiled_grammars_are_cached(llm):
    cache = GrammarCache(llm.tokenizer, MODEL_VOCAB, {1})
    a = cache.compile(constrained(json={"type": "object", "properties": {"x": {"type": "integer"}}}))
    b = cache.compile(constrained(json={"properties": {"x": {"type": "integer"}}, "type": "object"}))
    assert a is b and cache.compile(constrained(regex="a+")) is not a


def test_missing_xgrammar_names_the_extra(llm, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    with pytest.raises(ValueError, match=r"nano-vllm\[grammar\]"):
        GrammarCache(llm.tokenizer, MODEL_VOCAB, {1}).compile(constrained(regex="a+"))


def test_core_imports_without_xgrammar():
    code = ("import sys; sys.modules['xgrammar'] = None; import nanovllm, nanovllm.engine.llm_engine, "
            "nanovllm.sample.sampler; from nanovllm import SamplingParams, StructuredOutputsParams; "
            "SamplingParams(structured_outputs=StructuredOutputsParams(regex='a'))")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[2]))


def test_bitmask_matches_xgrammar_reference():
    torch.manual_seed(0)
    vocab, rows = 77, torch.tensor([0, 2])
    logits = torch.randn(3, vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 3), dtype=torch.int32)
    ours = apply_token_bitmask(logits, rows, bitmask)
    reference, full = logits.clone(), torch.full((3, 3), -1, dtype=torch.int32)  # -1: every bit set
    full[rows] = bitmask  # xgrammar's bitmask has a row per logits row
    xgr.apply_token_bitmask_inplace(reference, full, indices=rows.tolist())
    assert torch.equal(ours, reference) and not torch.equal(ours, logits)
    assert torch.equal(ours[1], logits[1])  # a row without a grammar is untouched


def test_tensor_parallel_and_chunked_prefill(model_dir, llm):
    """TP=2 (the sampler, hence the mask, on rank 0 only) with prompts prefilled in chunks gives
    TP=1's tokens; workers never receive a matcher (a Sequence's wire format has none)."""
    sp = SamplingParams(temperature=0, max_tokens=24, n=2, structured_outputs=constrained(regex=REGEX))
    prompts = ["a longer prompt that takes two chunks to prefill " * 2, "short"]
    expected = [c["token_ids"] for c in completions(llm.generate(prompts, sp, use_tqdm=False))]
    with LLM(model_dir, **dict(ENGINE, tensor_parallel_size=2, max_num_batched_tokens=64)) as tp2:
        seq = tp2.llm_engine.make_group("hi", sp)[0]
        assert seq.grammar is not None and not hasattr(pickle.loads(pickle.dumps(seq)), "grammar")
        got = [c["token_ids"] for c in completions(tp2.generate(prompts, sp, use_tqdm=False))]
    assert got == expected


def test_an_empty_language_ends_only_its_own_output(llm):
    """`root ::= root` compiles but allows no token: that output ends at once on EOS (under any
    sampling), its batch companions are untouched."""
    sp = [SamplingParams(temperature=0, max_tokens=8, structured_outputs=constrained(grammar="root ::= root")),
          SamplingParams(temperature=0, max_tokens=8, structured_outputs=constrained(choice=["ok"]))]
    empty, fine = llm.generate(PROMPTS[:2], sp, use_tqdm=False)
    assert (empty["finish_reason"], empty["token_ids"], empty["text"]) == ("stop", [1], "")
    assert fine["text"] == "ok"
    sampled = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=8,
                             structured_outputs=constrained(grammar="root ::= root"))
    empty = llm.generate(PROMPTS[:1], sampled, use_tqdm=False)[0]
    assert (empty["finish_reason"], empty["token_ids"]) == ("stop", [1])


def test_starts_after_leaves_the_output_free_until_the_marker(llm):
    """starts_after (the server's --reasoning-parser sets "</think>"): the tokens up to the marker's
    first occurrence are the unconstrained greedy ones, the text after it is in the language."""
    def spells_itself(t: int) -> bool:  # a whole character, not a piece of one
        return llm.tokenizer.encode(llm.tokenizer.decode([t]), add_special_tokens=False) == [t]
    free = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    checked = 0
    for prompt, out in zip(PROMPTS, free):
        ids = out["token_ids"]
        k = next((i for i in range(2, len(ids)) if ids[i] not in ids[:i] and spells_itself(ids[i])), None)
        if k is None:
            continue
        marker = llm.tokenizer.decode([ids[k]])
        params = SamplingParams(temperature=0, max_tokens=k + 40,
                                structured_outputs=constrained(regex=REGEX, starts_after=marker))
        got = llm.generate([prompt], params, use_tqdm=False)[0]
        assert got["token_ids"][:k + 1] == ids[:k + 1]
        assert re.fullmatch(REGEX, llm.tokenizer.decode(got["token_ids"][k + 1:], skip_special_tokens=True))
        checked += 1
    assert checked >= 2


def test_deferred_matcher_rolls_back_across_its_start(llm):
    from nanovllm.sample.structured_outputs import DeferredMatcher
    matcher = llm.llm_engine.grammars.new_matcher(constrained(regex="ab", starts_after="zz"))
    assert isinstance(matcher, DeferredMatcher)
    z, a, b = (llm.tokenizer.encode(c, add_special_tokens=False)[0] for c in "zab")
    bitmask = xgr.allocate_token_bitmask(1, MODEL_VOCAB)
    for t in (a, z, z):  # anything goes before the marker
        matcher.fill_next_token_bitmask(bitmask, 0)
        assert bool((bitmask == -1).all()) and matcher.accept_token(t) and not matcher.is_terminated()
    assert matcher.started and not matcher.accept_token(b) and matcher.accept_token(a)
    matcher.rollback(2)  # back over the grammar's token and one of the marker's
    assert not matcher.started and matcher.accept_token(z) and matcher.started
    assert matcher.accept_token(a) and matcher.accept_token(b) and not matcher.is_terminated()
    assert matcher.accept_token(1) and matcher.is_terminated()  # EOS ends the grammar
