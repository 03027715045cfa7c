"""Adapters through the server, driven by the official openai and anthropic clients: --lora-modules, a
request's `model` choosing its adapter in completions, chat, Responses and Messages, /v1/models, runtime
load and unload behind VLLM_ALLOW_RUNTIME_LORA_UPDATING, and the 400s / 404s."""
import pytest

pytest.importorskip("peft")
from server_fixtures import ENGINE_OPTIONS, MODEL, httpx, openai, serve_engine  # noqa: E402

from nanovllm import LLM, LoRARequest, SamplingParams  # noqa: E402
from nanovllm.entrypoints.openai_server import build_app  # noqa: E402
from lora_adapters import make_peft_adapter  # noqa: E402

LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
PROMPT = "the cat sat on the mat and"
CHAT = [{"role": "user", "content": "tell me about the cat"}]


@pytest.fixture(scope="module")
def adapter_paths(qwen3_gqa, tmp_path_factory):
    root = tmp_path_factory.mktemp("served-adapters")
    return [make_peft_adapter(qwen3_gqa, str(root / f"a{i}"), seed=10 + i, r=8, std=0.3) for i in range(2)]


@pytest.fixture(scope="module")
def served_lora(qwen3_gqa, adapter_paths):
    """One engine with adapters behind two apps: runtime updates allowed (the first) and not."""
    mp = pytest.MonkeyPatch()
    modules = (LoRARequest("sql", 1, adapter_paths[0]),)
    mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    updatable = lambda engine: build_app(engine, MODEL, lora_modules=modules)  # noqa: E731

    def fixed(engine):
        with pytest.MonkeyPatch.context() as inner:
            inner.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
            return build_app(engine, MODEL, lora_modules=modules)
    try:
        with serve_engine(LLM(qwen3_gqa, **ENGINE_OPTIONS, **LORA), [updatable, fixed]) as (engine, urls):
            yield urls
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def reference(qwen3_gqa, adapter_paths):
    """The offline engine's greedy answers: (prompt, chat) per adapter (None: the base model)."""
    sp = SamplingParams(temperature=0, max_tokens=8)
    answers = {}
    with LLM(qwen3_gqa, **ENGINE_OPTIONS, **LORA) as llm:
        for key, lora in ((None, None), ("sql", LoRARequest("sql", 1, adapter_paths[0])),
                          ("extra", LoRARequest("extra", 2, adapter_paths[1]))):
            answers[key] = (llm.generate([PROMPT], sp, use_tqdm=False, lora_request=lora)[0]["text"],
                            llm.chat(CHAT, sp, use_tqdm=False, lora_request=lora)[0]["text"])
    assert len({text for text, _ in answers.values()}) == 3, "the adapters must change the answer"
    return answers


def client_of(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_each_adapter_with_its_parent(served_lora):
    cards = {m.id: m for m in client_of(served_lora[0]).models.list().data}
    assert set(cards) == {MODEL, "sql"}
    assert cards["sql"].parent == MODEL and cards[MODEL].parent is None


def test_a_request_per_adapter_in_every_api(served_lora, reference):
    client = client_of(served_lora[0])
    for model, key in ((MODEL, None), ("sql", "sql")):
        text, chat = reference[key]
        done = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
        assert done.model == model and done.choices[0].text == text
        reply = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0)
        assert reply.model == model and reply.choices[0].message.content == chat
        response = client.responses.create(model=model, input=CHAT, max_output_tokens=8, temperature=0)
        assert response.model == model and response.output_text == chat
    anthropic = pytest.importorskip("anthropic")
    message = anthropic.Anthropic(base_url=served_lora[0], api_key="unused", max_retries=0).messages.create(
        model="sql", max_tokens=8, extra_body={"temperature": 0}, messages=CHAT)
    assert message.model == "sql" and message.content[0].text == reference["sql"][1]


def test_runtime_load_and_unload(served_lora, adapter_paths, reference):
    url, client = served_lora[0], client_of(served_lora[0])
    loaded = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": adapter_paths[1]})
    assert loaded.status_code == 200, loaded.text
    assert "extra" in {m.id for m in client.models.list().data}
    done = client.completions.create(model="extra", prompt=PROMPT, max_tokens=8, temperature=0)
    assert done.choices[0].text == reference["extra"][0]
    again = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": adapter_paths[1]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    unloaded = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "extra"})
    assert unloaded.status_code == 200, unloaded.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="extra", prompt=PROMPT, max_tokens=4)
    gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "extra"})
    assert gone.status_code == 404


def test_bad_adapters_and_names_are_refused(served_lora, tmp_path):
    url, client = served_lora[0], client_of(served_lora[0])
    missing = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "no")})
    assert missing.status_code == 400 and "does not exist" in missing.json()["error"]["message"]
    assert "x" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="no-such-adapter", messages=CHAT, max_tokens=4)
    base = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": MODEL, "lora_path": str(tmp_path)})
    assert base.status_code == 400


def test_embeddings_per_adapter(served_lora, qwen3_gqa, adapter_paths):
    """/v1/embeddings with an adapter's name: the offline engine's embeddings under that adapter."""
    with LLM(qwen3_gqa, **ENGINE_OPTIONS, **LORA) as llm:
        expected = {model: llm.embed(["hello"], lora_request=lora)[0]
                    for model, lora in ((MODEL, None), ("sql", LoRARequest("sql", 1, adapter_paths[0])))}
    assert expected[MODEL] != expected["sql"]
    client = client_of(served_lora[0])
    for model, vector in expected.items():
        got = client.embeddings.create(model=model, input="hello")
        assert got.model == model and got.data[0].embedding == pytest.approx(vector, abs=1e-5)


def test_runtime_updates_need_the_environment_variable(served_lora, adapter_paths):
    url = served_lora[1]
    refused = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": adapter_paths[1]})
    assert refused.status_code == 404
    assert {m.id for m in client_of(url).models.list().data} >= {MODEL, "sql"}


def test_cli_checks_lora_modules_before_loading(capsys):
    from nanovllm.cli import main
    assert main(["serve", "/nowhere", "--lora-modules", "sql=/tmp/a"]) == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
    assert main(["serve", "/nowhere", "--enable-lora", "--lora-modules", "sql"]) == 2
    assert "name=path" in capsys.readouterr().err
