"""What the tests of the families with state layers share (LFM2, Granite 4.0-H, Falcon-H1: tests/models):
the engine settings, greedy generation with its preemption count, call counting, the states zeroed
before each step, the C one call set aside, and llama.cpp's converter writing a checkpoint's file."""
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import save_decisive
from nanovllm import LLM, SamplingParams

FP32 = dict(dtype="float32", kv_cache_dtype="float32", kvcache_block_size=16, cpu_kvcache_bytes=8 << 20)

# A tiny Granite 4.0-H (tests/models/test_granite_hybrid.py; the Triton Mamba-2 step's engine test):
# two Mamba-2 layers (8 heads of 16 x 16, one group) and two attention layers, MoE with the shared
# MLP, every Granite multiplier away from 1.
GRANITE_VOCAB = 256
_rng = random.Random(0)
GRANITE_PROMPTS = [[_rng.randrange(3, GRANITE_VOCAB) for _ in range(n)] for n in (1, 9, 70, 150)]  # past two chunks
GRANITE_SHAPE = dict(vocab_size=GRANITE_VOCAB, hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                     num_experts_per_tok=2, layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=8,
                     mamba_n_groups=1, mamba_d_state=16, mamba_d_head=16, mamba_d_conv=4, mamba_expand=2,
                     mamba_chunk_size=64, position_embedding_type="rope", embedding_multiplier=12.0, logits_scaling=4.0,
                     residual_multiplier=0.22, attention_multiplier=0.0078125, max_position_embeddings=512,
                     eos_token_id=1, bos_token_id=2, pad_token_id=0)


def make_granite(path: str, **overrides) -> str:
    import transformers
    config = transformers.GraniteMoeHybridConfig(**{**GRANITE_SHAPE, **overrides})
    config.architectures = ["GraniteMoeHybridForCausalLM"]
    torch.manual_seed(3)
    model = transformers.GraniteMoeHybridForCausalLM(config)
    with torch.no_grad():  # time steps of a useful size (softplus(dt + dt_bias) near 0.1-1), decays of A
        for layer in model.model.layers:
            if layer.mamba is not None:
                layer.mamba.dt_bias.uniform_(-2.0, 0.5)
                layer.mamba.A_log.uniform_(-1.0, 1.0)
                layer.mamba.D.normal_(1.0, 0.3)
    return save_decisive(model, path, GRANITE_VOCAB)


def generate(path: str, batch, max_new: int, **engine) -> tuple[list[list[int]], int]:
    """Greedy tokens of each prompt, and the scheduler's preemptions."""
    with LLM(path, **{**FP32, **engine}) as llm:
        outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True), use_tqdm=False)
        return [o["token_ids"] for o in outs], llm.llm_engine.scheduler.num_preemptions


def counted(monkeypatch, owner, name: str) -> list:
    """owner.name wrapped to count its calls: the list it appends to."""
    calls, real = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *args: calls.append(1) or real(*args))
    return calls


def zeroed_before_each_step(monkeypatch, tensors) -> None:
    """Every engine step starts with these tensors (a layer kind's state slots) zeroed."""
    from nanovllm.engine.llm_engine import LLMEngine
    real = LLMEngine.step
    monkeypatch.setattr(LLMEngine, "step", lambda self: [t.zero_() for t in tensors] and real(self))


def modules_of(llm, cls) -> list:
    return [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, cls)]


def without_one_call(llm) -> None:
    """The decode steps through the model's forward (the C one-call step set aside)."""
    llm.llm_engine.model_runner.step_runners = []


def mixers(llm) -> list:
    """The model's Mamba-2 mixers."""
    from nanovllm.layers.mamba2 import Mamba2Mixer
    return modules_of(llm, Mamba2Mixer)


def check_eager_mamba2_decode(path: str, refs, prompts, greedy: SamplingParams, where: str, monkeypatch) -> None:
    """With the one call set aside: each Mamba-2 mixer's decode step one C call (mamba2_decode, its
    calls counted, at least one a step), or the torch step (where "torch"); refs' tokens and
    log-probabilities either way."""
    from lora_adapters import assert_like_peft
    with LLM(path, **FP32, max_num_batched_tokens=40, max_num_seqs=2) as llm:
        without_one_call(llm)
        layers = mixers(llm)
        if where == "torch":
            for m in layers:
                m.c_desc = None
        calls = counted(monkeypatch, layers[0].c_kernels, "mamba2_decode")
        assert_like_peft(llm.generate(prompts, greedy, use_tqdm=False), refs, f"{where} decode")
        assert (len(calls) >= greedy.max_tokens - 1) if where == "c" else not calls


def llamacpp_file(tmp_path: Path, hf: str, outtype: str, specials: tuple[str, ...] = ()) -> Path:
    """hf written by llama.cpp's convert_hf_to_gguf.py (its vocabulary step gets the vendored Qwen2
    tokenizer, llamacpp_build.with_qwen2_tokenizer); skipped where the converters are not fetched."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import llamacpp_build
    from nanovllm.utils.cache import cache_root
    llama = llamacpp_build.source_fetched(cache_root())
    if llama is None:
        pytest.skip("llama.cpp's converters are not fetched: run `python scripts/llamacpp_build.py --source` "
                    "(the README's test command does)")
    folder = llamacpp_build.with_qwen2_tokenizer(hf, llama, tmp_path / f"{outtype}-vocab", specials)
    out = tmp_path / f"{outtype}.gguf"
    done = subprocess.run([sys.executable, str(llama / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype,
                           "--outfile", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return out
