"""Sampling options over HTTP: each response equals the offline engine's for the same params."""
import pytest

openai = pytest.importorskip("openai")

from nanovllm import SamplingParams  # noqa: E402

from server_fixtures import MODEL, client, ref_llm, served  # noqa: E402,F401  (fixtures are used by name)

def stream_text(chunks) -> tuple[str, str | None]:
    chunks = list(chunks)
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].choices[0].finish_reason


def test_stop_strings(client, ref_llm):
    prompt = "old quiet rivers and"
    greedy = ref_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                              use_tqdm=False)[0]
    words = greedy["text"].split(" ")
    spanning = words[3][-2:] + " " + words[4][:2]  # starts in one token, ends in the next
    for stop, include in ((spanning, False), (spanning, True), ([words[6], "never there"], False)):
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=stop,
                            include_stop_str_in_output=include)
        ref = ref_llm.generate([prompt], sp, use_tqdm=False)[0]
        assert ref["finish_reason"] == "stop" and len(ref["text"]) < len(greedy["text"])
        kwargs = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=stop,
                      extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
        out = client.completions.create(**kwargs)
        assert (out.choices[0].text, out.choices[0].finish_reason) == (ref["text"], "stop")
        assert out.usage.completion_tokens == len(ref["token_ids"])
        # The stream never sends text that the stop string later cuts off.
        assert stream_text(client.completions.create(stream=True, **kwargs)) == (ref["text"], "stop")


def test_seeded_sampling_and_n(client, ref_llm):
    prompt = "seven bright stars"
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, n=3, ignore_eos=True)
    ref = ref_llm.generate([prompt], sp, use_tqdm=False)[0]["outputs"]
    assert len({r["text"] for r in ref}) > 1  # completions of one seeded request differ
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, n=3,
                  extra_body={"ignore_eos": True})
    out = client.completions.create(**kwargs)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [r["text"] for r in ref]
    assert out.usage.completion_tokens == 36
    texts = ["", "", ""]
    for chunk in client.completions.create(stream=True, **kwargs):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [r["text"] for r in ref]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], n=2,
                                          max_tokens=12, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    ref_chat = ref_llm.chat([{"role": "user", "content": prompt}],
                            SamplingParams(temperature=1.0, max_tokens=12, seed=7, n=2, ignore_eos=True),
                            use_tqdm=False)[0]["outputs"]
    assert [c.message.content for c in chat.choices] == [r["text"] for r in ref_chat]


def test_logprobs(client, ref_llm):
    prompt = "the city of paris"
    ref = ref_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True),
                           use_tqdm=False)[0]
    chosen = [d[t] for d, t in zip(ref["logprobs"], ref["token_ids"])]
    token_texts = [ref_llm.tokenizer.decode([t]) for t in ref["token_ids"]]
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3,
                  extra_body={"ignore_eos": True})
    lp = client.completions.create(**kwargs).choices[0].logprobs
    assert lp.tokens == token_texts
    assert lp.token_logprobs == pytest.approx(chosen, abs=1e-4)
    assert all(len(top) == 3 and max(top.values()) == pytest.approx(lp_, abs=1e-4)  # greedy: chosen is best
               for top, lp_ in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in token_texts[:i]) for i in range(len(token_texts))]
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kwargs)
                if c.choices[0].logprobs]
    assert sum((s.token_logprobs for s in streamed), []) == pytest.approx(chosen, abs=1e-4)
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset

    messages = [{"role": "user", "content": prompt}]
    ref_chat = ref_llm.chat(messages, SamplingParams(temperature=0, max_tokens=8, logprobs=2), use_tqdm=False)[0]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [d[t] for d, t in zip(ref_chat["logprobs"], ref_chat["token_ids"])], abs=1e-4)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)
    assert all(bytes(c.bytes) == c.token.encode() for c in content)
