"""Library streaming: LLM.generate_stream deltas add up to generate()'s outputs (multi-byte text and
stop strings too) and decode no more often; closing or collecting a stream
aborts its requests; incremental text never shows a broken multi-byte character."""
import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.outputs.output_processor import OutputProcessor

from helpers import WORDS

PROMPTS = ["the quick brown fox", "seven bright stars shine", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
           "paris"]


@pytest.fixture(scope="module")
def llm(qwen3_gqa):
    # A 5-block cache for requests needing 10 blocks in all: long decodes preempt, streams must survive that.
    with LLM(qwen3_gqa, kvcache_block_size=16, max_model_len=128, cpu_kvcache_bytes=5 * 16384, kv_cache_dtype="float32") as engine:
        yield engine


def concat(deltas, n: int) -> tuple[list[str], list[list[int]], list[str | None]]:
    texts, ids, reasons = [""] * n, [[] for _ in range(n)], [None] * n
    for d in deltas:
        assert reasons[d.request_id] is None, "a delta after the last one"
        texts[d.request_id] += d.text
        ids[d.request_id] += d.token_ids
        reasons[d.request_id] = d.finish_reason
        assert d.num_output_tokens == len(ids[d.request_id])
    return texts, ids, reasons


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_stream_adds_up_to_generate(llm, ignore_eos):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=ignore_eos) for n in (30, 7, 25, 40)]
    ref = llm.generate(PROMPTS, params, use_tqdm=False)
    preemptions = llm.llm_engine.scheduler.num_preemptions
    deltas = list(llm.generate_stream(PROMPTS, params))
    texts, ids, reasons = concat(deltas, len(PROMPTS))
    assert texts == [r["text"] for r in ref]
    assert ids == [r["token_ids"] for r in ref]
    assert reasons == [r["finish_reason"] for r in ref]
    assert len(deltas) > len(PROMPTS)  # tokens came one step at a time, not all at the end
    if ignore_eos:
        assert llm.llm_engine.scheduler.num_preemptions > preemptions  # the streams lived through preemption
    assert llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks == llm.llm_engine.num_kvcache_blocks


def test_stream_with_stop_strings_n_and_logprobs(llm):
    prompt = "old quiet rivers"
    words = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0]["text"].split(" ")
    spanning = words[2][-2:] + " " + words[3][:2]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=spanning),
              SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=5, n=2, logprobs=2)]
    prompts = [prompt, "the lazy dog"]
    refs = llm.generate(prompts, params, use_tqdm=False)
    assert refs[0]["finish_reason"] == "stop"
    got: dict[tuple, dict] = {}
    for d in llm.generate_stream(prompts, params):
        out = got.setdefault((d.request_id, d.index), {"text": "", "token_ids": [], "logprobs": []})
        out["text"] += d.text
        out["token_ids"] += d.token_ids
        out["logprobs"] += d.logprobs or []
        if d.logprobs is not None:
            assert len(d.logprobs) == len(d.token_ids) and set(d.token_texts) >= set(d.token_ids)
    assert sorted(got) == [(0, 0), (1, 0), (1, 1)]
    for (i, j), out in got.items():
        ref = refs[i]["outputs"][j]
        assert (out["text"], out["token_ids"]) == (ref["text"], ref["token_ids"])
        if i == 1:
            assert out["logprobs"] == ref["logprobs"]


def test_closing_a_stream_aborts_and_frees_blocks(llm):
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    stream = llm.generate_stream(PROMPTS[:2], params)
    seen = 0
    for delta in stream:
        seen += len(delta.token_ids)
        if seen >= 6:
            break
    assert llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks < llm.llm_engine.num_kvcache_blocks
    stream.close()
    assert llm.llm_engine.is_finished()
    assert llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks == llm.llm_engine.num_kvcache_blocks
    ref = llm.generate(["paris"], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    texts, _, _ = concat(llm.generate_stream(["paris"], SamplingParams(temperature=0, max_tokens=5)), 1)
    assert texts == [ref["text"]]


def test_bad_prompt_queues_nothing(llm):
    with pytest.raises(ValueError, match="empty string"):
        next(llm.generate_stream(["the fox", ""], SamplingParams(max_tokens=3)))
    assert llm.llm_engine.is_finished()


def _byte_level_tokenizer():
    """One token per UTF-8 byte: a multi-byte character always spans several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_incremental_text_never_splits_a_character():
    tokenizer = _byte_level_tokenizer()
    text = "héllo wörld, 世界 " + WORDS[0] + " 🦊!"
    token_ids = tokenizer.encode(text)
    assert len(token_ids) == len(text.encode())  # byte-level, so characters do span tokens
    outputs = OutputProcessor(tokenizer)
    seq = Sequence([0], SamplingParams(max_tokens=len(token_ids)))
    outputs.add(seq, request_id="r", stream=True)
    pieces = []
    for i, token_id in enumerate(token_ids):
        seq.append_token(token_id)
        if i == len(token_ids) - 1:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
        assert outputs.process([seq], [True], [None]) == []
        (delta,) = outputs.finish_step([seq])
        assert "\ufffd" not in delta.text
        pieces.append(delta.text)
    assert "".join(pieces) == text
    assert pieces[1] == ""  # "é" waits for its second byte ...
    assert pieces[2] == "é"  # ... and comes out whole
    assert not outputs.states


def test_weights_only_folder_streams_token_ids(qwen3_gqa, tmp_path):
    import shutil

    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{qwen3_gqa}/{name}", tmp_path)
    prompts = [[5, 6, 7], [9, 8]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(tmp_path), kvcache_block_size=16, max_model_len=64, cpu_kvcache_bytes=8 * 16384, kv_cache_dtype="float32") as bare:
        assert bare.tokenizer is None
        ref = bare.generate(prompts, params, use_tqdm=False)
        deltas = list(bare.generate_stream(prompts, params))
        with pytest.raises(ValueError, match="stop strings need"):
            bare.generate(prompts, SamplingParams(stop="x"), use_tqdm=False)
    assert all(d.text is None for d in deltas) and all(r["text"] is None for r in ref)
    for i, r in enumerate(ref):
        assert sum((d.token_ids for d in deltas if d.request_id == i), []) == r["token_ids"]


@pytest.fixture(scope="module")
def byte_llm(qwen3_gqa, tmp_path_factory):
    """The tiny model behind a one-token-per-byte tokenizer: its random output is full of
    characters (and broken ones) that span tokens."""
    import shutil

    path = tmp_path_factory.mktemp("qwen3_bytes")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{qwen3_gqa}/{name}", path)
    _byte_level_tokenizer().save_pretrained(path)
    with LLM(str(path), kvcache_block_size=16, max_model_len=128, cpu_kvcache_bytes=16 * 16384, kv_cache_dtype="float32") as engine:
        yield engine


MULTIBYTE_PROMPTS = ["café 日本 🙂", "naïve façade — ok", "Ünïcödé ☃ snow", "🦊 fox"]


def multibyte_stops(llm) -> tuple[list[str], list[SamplingParams]]:
    """Stop strings: every whole non-ASCII character of the unstopped outputs (so they span tokens)."""
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)
    texts = [o["text"] for o in llm.generate(MULTIBYTE_PROMPTS, params, use_tqdm=False)]
    stops = sorted({c for t in texts for c in t[4:] if ord(c) > 127 and c != "\ufffd"})
    assert len(stops) >= 2
    return texts, [SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True, stop=stops)]


def test_stream_with_stop_strings_over_multibyte_text_adds_up_to_generate(byte_llm):
    unstopped, (params,) = multibyte_stops(byte_llm)
    refs = byte_llm.generate(MULTIBYTE_PROMPTS, params, use_tqdm=False)
    assert sum(r["finish_reason"] == "stop" for r in refs) >= 2
    for text, ref in zip(unstopped, refs):  # the reference: the full decode, cut at the first stop
        if ref["finish_reason"] == "stop":
            assert ref["text"] == text[:text.index(ref["stop_reason"])]
    texts, ids, reasons = concat(byte_llm.generate_stream(MULTIBYTE_PROMPTS, params), len(MULTIBYTE_PROMPTS))
    assert texts == [r["text"] for r in refs]
    assert ids == [r["token_ids"] for r in refs]
    assert reasons == [r["finish_reason"] for r in refs]


def test_a_streamed_request_is_detokenized_once(byte_llm, monkeypatch):
    """Stop strings and the stream read one detokenizer: streaming adds (almost) no decode calls."""
    _, (params,) = multibyte_stops(byte_llm)
    tokenizer = byte_llm.tokenizer
    real_decode, calls = tokenizer.decode, [0]

    def counting_decode(*args, **kwargs):
        calls[0] += 1
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "decode", counting_decode)
    refs = byte_llm.generate(MULTIBYTE_PROMPTS, params, use_tqdm=False)
    offline, calls[0] = calls[0], 0
    deltas = list(byte_llm.generate_stream(MULTIBYTE_PROMPTS, params))
    streamed = calls[0]
    num_tokens = sum(len(r["token_ids"]) for r in refs)
    assert len(deltas) > len(refs) and offline >= num_tokens  # stop strings: decoded token by token
    # At most one final snapshot (two decodes) more per request than offline.
    assert streamed <= offline + 2 * len(refs)


def test_a_collected_stream_aborts_its_requests(llm):
    import gc

    stream = llm.generate_stream(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    next(stream)
    assert not llm.llm_engine.is_finished()
    del stream
    gc.collect()
    assert llm.llm_engine.is_finished() and not llm.llm_engine.output_processor.states
    assert llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks == llm.llm_engine.num_kvcache_blocks
