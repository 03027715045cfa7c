"""Incremental detokenizer and stop strings, on a byte-level BPE tokenizer that splits multi-byte
characters across tokens; the reference is the tokenizer's own decode of all tokens."""
import pytest

from nanovllm.outputs.detokenizer import (IncrementalDetokenizer, RequestText, added_token_texts, decode_text,
                                         find_stop)

TEXT = "the café 日本 🙂 fox jumps"


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20 + ["naïve café"] * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def test_text_grows_by_whole_characters_and_ends_as_the_full_decode(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some characters span tokens
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    for i, token_id in enumerate(ids):
        detok.add_token(token_id)
        assert "\ufffd" not in detok.text and TEXT.startswith(detok.text)
        assert detok.full_text() == tokenizer.decode(ids[: i + 1])  # a snapshot changes nothing
    assert detok.text == detok.full_text() == tokenizer.decode(ids) == TEXT


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("the fox") + [tokenizer.eos_token_id] + tokenizer.encode(" jumps")
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        for t in ids:
            detok.add_token(t)
        assert detok.full_text() == tokenizer.decode(ids, skip_special_tokens=skip)


def feed(tokenizer, stops, include=False, min_tokens=0):
    """Feed TEXT's tokens until a stop string; returns (tokens fed, stop, final text)."""
    matcher = RequestText(tokenizer, stops, True, include, min_tokens)
    ids = tokenizer.encode(TEXT)
    for n, token_id in enumerate(ids, start=1):
        stop = matcher.add_token(token_id, n)
        if stop is not None:
            return n, stop, matcher.text
    return len(ids), None, matcher.text


def tokens_until(tokenizer, needle: str) -> int:
    ids = tokenizer.encode(TEXT)
    return next(k for k in range(1, len(ids) + 1) if needle in tokenizer.decode(ids[:k]))


@pytest.mark.parametrize("stop", ["本", "é 日", "🙂 f", "jumps"])
def test_stop_strings_across_tokens_and_characters(tokenizer, stop):
    n, found, text = feed(tokenizer, [stop])
    assert found == stop and n == tokens_until(tokenizer, stop)
    assert text == TEXT[: TEXT.index(stop)]
    assert feed(tokenizer, [stop], include=True)[2] == TEXT[: TEXT.index(stop) + len(stop)]


def test_earliest_stop_wins_and_min_tokens_defers_matching(tokenizer):
    n, found, text = feed(tokenizer, ["fox", "café"])
    assert found == "café" and text == "the "
    late = tokens_until(tokenizer, "fox")
    n, found, text = feed(tokenizer, ["fox", "café"], min_tokens=late - 1)
    assert found == "fox" and n == late  # café was passed while matching was off
    assert feed(tokenizer, ["café"], min_tokens=late)[1] is None


def test_find_stop_searches_back_over_the_previous_text():
    assert find_stop("abcdef", 4, ["cde"]) == (2, "cde")
    assert find_stop("abcdef", 5, ["bc"]) is None  # ended before the new text
    assert find_stop("hello world", 9, ["ld", "world"]) == (6, "world")  # the earliest start wins


@pytest.mark.parametrize("stop", ["本", "é 日", "🙂 f", "jumps"])
def test_streamable_text_is_always_a_prefix_of_the_final_text(tokenizer, stop):
    """A stream sends streamable_text(): never a broken character, never text a stop string cuts."""
    for include in (False, True):
        text = RequestText(tokenizer, [stop], True, include, 0)
        sent = []
        for n, token_id in enumerate(tokenizer.encode(TEXT), start=1):
            if text.add_token(token_id, n) is not None:
                break
            sent.append(text.streamable_text())
        assert all(text.text.startswith(s) and "\ufffd" not in s for s in sent)
        assert len(sent[-1]) >= TEXT.index(stop) - len(stop)  # held back no more than needed
    no_stops = RequestText(tokenizer, [], True, False, 0)
    for token_id in tokenizer.encode(TEXT):
        no_stops.add_token(token_id, 1)
    assert no_stops.streamable_text() == TEXT  # nothing held back without stop strings


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    """Its decoder puts a space between every two tokens, special ones included."""
    from helpers import make_tokenizer
    return make_tokenizer(str(tmp_path_factory.mktemp("words")))


# the <eos> quick <bos> brown: specials between words, and two in a row at the end.
WORD_IDS = [3, 1, 4, 2, 5, 1, 2]


@pytest.mark.parametrize("skip, spaces, expected", [
    (False, True, None),  # None: the tokenizer's own decode
    (False, False, "the<eos>quick<bos>brown<eos><bos>"),  # by hand: no separator around a special
    (True, True, None),
    (True, False, "the quick brown"),  # a skipped special does not split the words around it
])
def test_spaces_between_special_tokens(word_tokenizer, skip, spaces, expected):
    assert word_tokenizer.decode(WORD_IDS, skip_special_tokens=False) == "the <eos> quick <bos> brown <eos> <bos>"
    if expected is None:
        expected = word_tokenizer.decode(WORD_IDS, skip_special_tokens=skip)
    detok = IncrementalDetokenizer(word_tokenizer, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    for t in WORD_IDS:
        detok.add_token(t)
    assert detok.text == expected
    added = None if spaces else added_token_texts(word_tokenizer)
    assert decode_text(word_tokenizer, WORD_IDS, skip, added) == expected


def test_spaces_between_special_tokens_reaches_the_engine_output(word_tokenizer, qwen3_gqa):
    """The final text of a finished request (decoded once) and a stream's text both honour it."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.engine.sequence import Sequence
    from nanovllm.outputs.output_processor import OutputProcessor

    sp = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False, ignore_eos=True)
    seq = Sequence([3, 4], sp)
    seq.append_token(1)
    seq.append_token(5)
    seq.finish_reason = "length"
    assert OutputProcessor(word_tokenizer)._text(seq, None) == "<eos>brown"
    with LLM(qwen3_gqa, kvcache_block_size=16, max_model_len=128, cpu_kvcache_bytes=32 * 16384) as llm:
        for stop in (None, ["zzz"]):  # decoded once at the end / incrementally (stop strings)
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, skip_special_tokens=False,
                                    spaces_between_special_tokens=False, stop=stop)
            out = llm.generate([[3, 4, 5]], params, use_tqdm=False)[0]
            assert 0 in out["token_ids"]  # this prompt's greedy output holds <unk>
            assert "<unk>" in out["text"] and " <unk>" not in out["text"] and "<unk> " not in out["text"]
            assert out["text"] == decode_text(llm.tokenizer, out["token_ids"], False,
                                              added_token_texts(llm.tokenizer))
