"""Embeddings (LLM.embed, /v1/embeddings): the prompt's final hidden states pooled and normalised,
against transformers' last_hidden_state (fp32, cosine > 0.9999) with last-token, mean and CLS
pooling; batches split by max_num_batched_tokens give the same vectors; bad input named; through
the openai client's embeddings.create, float and base64."""
import base64
import json
import shutil

import numpy as np
import pytest
import torch

from nanovllm import LLM

ENGINE = dict(dtype="float32", kv_cache_dtype="float32", kvcache_block_size=16, max_model_len=128)
PROMPTS = [[5, 6, 7, 8], list(range(10, 60)), [3] * 9, [200, 201]]


def reference(path: str, prompts: list[list[int]], method: str) -> torch.Tensor:
    from transformers import AutoModel
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            h = model(torch.tensor([p])).last_hidden_state[0]
            out.append({"last": h[-1], "mean": h.mean(0), "cls": h[0]}[method])
    return torch.nn.functional.normalize(torch.stack(out), dim=-1)


@pytest.fixture(scope="module")
def llm(qwen3_gqa):
    with LLM(qwen3_gqa, max_num_batched_tokens=64, max_num_seqs=4, **ENGINE) as engine:
        yield engine


@pytest.mark.parametrize("method", ["last", "mean", "cls"])
def test_like_transformers(llm, qwen3_gqa, method):
    ours = torch.tensor(llm.embed(PROMPTS, pooling=method))
    ref = reference(qwen3_gqa, PROMPTS, method)
    cosine = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    assert cosine.min() > 0.9999, cosine
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(PROMPTS)), atol=1e-5)


def test_batches_and_the_kv_cache_untouched(llm):
    # max_num_batched_tokens 64: the 50-token prompt runs in a forward of its own, the rest together.
    together = llm.embed(PROMPTS)
    alone = [llm.embed([p])[0] for p in PROMPTS]
    assert np.allclose(together, alone, atol=1e-5)
    assert llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks == llm.llm_engine.num_kvcache_blocks


def test_the_checkpoint_says_how_to_pool(qwen3_gqa, tmp_path):
    path = tmp_path / "st"
    shutil.copytree(qwen3_gqa, path)
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    with LLM(str(path), **ENGINE) as llm:
        ours = torch.tensor(llm.embed(PROMPTS))
    assert torch.nn.functional.cosine_similarity(ours, reference(qwen3_gqa, PROMPTS, "mean")).min() > 0.9999


@pytest.mark.parametrize("prompts, pooling, words", [
    ([[5, 999]], None, "outside the vocabulary"),
    ([list(range(3, 140))], None, "longer than max_model_len"),
    ([[]], None, "empty list of token ids"),
    ([[5]], "max", "pooling must be one of"),
])
def test_bad_input(llm, prompts, pooling, words):
    with pytest.raises(ValueError, match=words):
        llm.embed(prompts, pooling=pooling)


def test_through_the_openai_client(llm, qwen3_gqa):
    from server_fixtures import MODEL, openai, serve_engine
    from nanovllm.entrypoints.openai_server import build_app

    server_llm = LLM(qwen3_gqa, **ENGINE)
    with serve_engine(server_llm, [lambda engine: build_app(engine, MODEL)]) as (_, (url,)):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        floats = client.embeddings.create(model=MODEL, input=PROMPTS)
        b64 = client.embeddings.with_raw_response.create(model=MODEL, input=PROMPTS[:1], encoding_format="base64")
        one = client.embeddings.create(model=MODEL, input=PROMPTS[0])
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model=MODEL, input=[[5, 999]])
        with pytest.raises(openai.BadRequestError) as dims:
            client.embeddings.create(model=MODEL, input="x", dimensions=3)
    want = llm.embed(PROMPTS)
    assert np.allclose([d.embedding for d in floats.data], want, atol=1e-5)
    assert floats.usage.prompt_tokens == sum(map(len, PROMPTS))
    raw = json.loads(b64.http_response.text)["data"][0]["embedding"]
    assert np.allclose(np.frombuffer(base64.b64decode(raw), dtype="<f4"), want[0], atol=1e-5)
    assert np.allclose(one.data[0].embedding, want[0], atol=1e-5)
    assert "outside the vocabulary" in e.value.message
    assert "dimensions must be this model's size (64)" in dims.value.message


def test_pooling_runner_embeds_and_refuses_generation(llm, qwen3_gqa):
    """`nanovllm serve --runner pooling` (vLLM's flag): one KV cache block, the same vectors through
    the openai client, and a generation request a 400 naming the runner."""
    from agent_fixtures import serve
    from server_fixtures import openai

    with LLM(qwen3_gqa, runner="pooling", **ENGINE) as pooling:
        assert pooling.llm_engine.num_kvcache_blocks == 1
        assert np.allclose(pooling.embed(PROMPTS), llm.embed(PROMPTS), atol=1e-5)
        with pytest.raises(ValueError, match="pooling runner"):
            pooling.generate([[5, 6]], use_tqdm=False)
    with serve(qwen3_gqa, "--runner", "pooling", "--served-model-name", "m", "--max-model-len", "128",
               "--dtype", "float32", "--kv-cache-dtype", "float32") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        vectors = [d.embedding for d in client.embeddings.create(model="m", input=PROMPTS).data]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert np.allclose(vectors, llm.embed(PROMPTS), atol=1e-5)
    assert "pooling runner" in e.value.message
    with pytest.raises(ValueError, match="runner must be"):
        LLM(qwen3_gqa, runner="embed", **ENGINE)
