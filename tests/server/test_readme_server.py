"""The README's server snippet, run as a user runs it: the openai client against a served engine
(here in-process, the tiny model under the default model's name); it prints the answer and ends
the line."""
import contextlib
import io
import re
from pathlib import Path

from server_fixtures import ENGINE_OPTIONS, serve_engine  # noqa: F401 (skips without the server extra)

from nanovllm import LLM
from nanovllm.entrypoints.openai_server import build_app
from nanovllm.utils.default_model import MODEL_DIRNAME

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def server_snippet() -> str:
    section = README[README.index("## As a server"):]
    (code,) = re.findall(r"```python\n(.*?)```", section[:section.index("\n## ", 3)], re.S)
    return code


def test_the_snippet_prints_a_greedy_answer_and_a_newline(qwen3_gqa):
    code = server_snippet()
    assert 'base_url="http://127.0.0.1:8000/v1"' in code and "temperature=0" in code
    with LLM(qwen3_gqa, **ENGINE_OPTIONS) as ref:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        from nanovllm import SamplingParams
        want = ref.chat([messages], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]["text"]
    llm = LLM(qwen3_gqa, **ENGINE_OPTIONS)
    with serve_engine(llm, [lambda engine: build_app(engine, MODEL_DIRNAME)]) as (_, (url,)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(code.replace("http://127.0.0.1:8000", url), {})
    assert out.getvalue() == want + "\n"
