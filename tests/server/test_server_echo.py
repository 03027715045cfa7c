"""/v1/completions' echo and prompt logprobs (as lm-eval's local-completions asks: echo, logprobs=1,
max_tokens=1, token-id prompts) through the openai client, against the offline engine's
prompt_logprobs; vLLM's prompt_logprobs field; GET /tokenizer_info."""
import pytest

openai = pytest.importorskip("openai")

from nanovllm import SamplingParams  # noqa: E402

from server_fixtures import MODEL, client, ref_llm, served  # noqa: E402,F401  (fixtures are used by name)
from server_fixtures import httpx  # noqa: E402


def test_echo_with_logprobs_equals_the_engines_prompt_logprobs(client, ref_llm):
    prompts = [ref_llm.tokenizer.encode("the quick brown fox jumps"), ref_llm.tokenizer.encode("seven bright stars")]
    refs = ref_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1),
                            use_tqdm=False)
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=1, temperature=0, logprobs=1, echo=True)
    decode = ref_llm.tokenizer.decode
    for prompt, ref, choice in zip(prompts, refs, out.choices):
        ids = prompt + ref["token_ids"]
        texts = [decode([t]) for t in ids]
        assert choice.text == decode(prompt) + ref["text"]
        lp = choice.logprobs
        assert lp.tokens == texts
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        expected = [d[t] for d, t in zip(ref["prompt_logprobs"][1:], prompt[1:])] + [ref["logprobs"][0][ids[-1]]]
        assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
        for j, top in enumerate(lp.top_logprobs[1:], start=1):
            d = ref["prompt_logprobs"][j] if j < len(prompt) else ref["logprobs"][0]
            best = max(d, key=d.get)  # logprobs=1: the most likely token of the position
            assert top == {decode([best]): pytest.approx(d[best], abs=1e-4)}
        assert lp.text_offset == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]


def test_echo_without_logprobs_and_the_prompt_logprobs_field(client, ref_llm):
    prompt = "a lazy dog while seven"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                    extra_body={"prompt_logprobs": 2})
    ref = ref_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2),
                           use_tqdm=False)[0]
    choice = out.choices[0]
    assert choice.text == prompt + ref["text"]
    assert choice.logprobs is None
    field = choice.model_extra["prompt_logprobs"]
    assert len(field) == len(ref["prompt_token_ids"]) and field[0] is None
    for got, want in zip(field[1:], ref["prompt_logprobs"][1:]):
        assert {int(t) for t in got} == set(want)
        for t, v in got.items():
            assert v["logprob"] == pytest.approx(want[int(t)], abs=1e-4)
            assert v["decoded_token"] == ref_llm.tokenizer.decode([int(t)])
        ranked = sorted((v["rank"], v["logprob"]) for v in got.values() if v["rank"] is not None)
        assert [r for r, _ in ranked] == list(range(1, len(ranked) + 1)) and len(ranked) >= 2
        assert [lp for _, lp in ranked] == sorted((lp for _, lp in ranked), reverse=True)


def test_prompt_logprobs_over_the_cap_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=MODEL, prompt="the fox", max_tokens=1, extra_body={"prompt_logprobs": 21})


def test_tokenizer_info(served, ref_llm):
    info = httpx.get(served[1] + "/tokenizer_info", timeout=30).json()
    tokenizer = ref_llm.tokenizer
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["model_max_length"] == ref_llm.config.max_model_len
    assert info["chat_template"] == tokenizer.chat_template
    assert info["eos_token"] == tokenizer.eos_token
