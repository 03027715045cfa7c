"""The CPU C kernels of small decode batches: the linear kernel (fp32 and bf16 weights, 1..9 rows,
shapes off the kernel's 8-lane and tile multiples) against a plain-torch matmul; the fused decode
step (executor/cpu_decode.py) against the eager forward on every model family's tiny checkpoint,
tokens and logprobs, with fp32 and bf16 weights; and the engine without a C compiler."""
import shutil

import pytest
import torch

from helpers import make_qwen3
from nanovllm import LLM, SamplingParams
from nanovllm.executor import cpu_decode
from nanovllm.kernels import cpu_kernels
from nanovllm.layers.quantization.unquantized import dense_c_view
from nanovllm.executor.cpu_decode import FusedDecode
from tiny_models import make_tiny

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler")


@pytest.fixture(scope="module")
def kernels():
    k = cpu_kernels.load()
    assert k is not None
    return k


def c_linear(kernels, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return cpu_kernels.linear(kernels, cpu_kernels.linear_struct(kernels, dense_c_view(w)), x, bias)


@pytest.mark.parametrize("n,k", [(37, 45), (4, 8), (33, 3), (64, 40), (5, 1)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_linear_kernel_matches_torch(kernels, n, k, rows, weight_dtype):
    torch.manual_seed(n * 100 + k + rows)
    w = torch.randn(n, k).to(weight_dtype)
    x, bias = torch.randn(rows, k), torch.randn(n)
    ref = x.double() @ w.double().T  # the bf16 values widened exactly, summed in fp64
    torch.testing.assert_close(c_linear(kernels, x, w, None).double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c_linear(kernels, x, w, bias).double(), ref + bias.double(),
                               rtol=1e-5, atol=1e-5)


def test_linear_kernel_rejects_other_weight_dtypes(kernels):
    """A dense fp16 weight gets no C view (the dense path keeps it in torch); a format without a row
    in the C weight-type table has no type code; a description with a code outside the table, or
    rows of the wrong size, is refused by the C side, not run as fp32."""
    assert dense_c_view(torch.randn(4, 8).half()) is None
    with pytest.raises(ValueError, match="no weight type 'tq1_0'"):
        kernels.weight_type("tq1_0")
    w = torch.randn(4, 8)
    good = cpu_kernels.linear_struct(kernels, dense_c_view(w))
    torch.testing.assert_close(cpu_kernels.linear(kernels, good, torch.ones(1, 8), None), w.sum(1, keepdim=True).T)
    for field, value in (("type", 99), ("type", -1), ("row_bytes", 16)):
        bad = cpu_kernels.linear_struct(kernels, dense_c_view(w))
        setattr(bad, field, value)
        with pytest.raises(ValueError, match="refused"):
            cpu_kernels.linear(kernels, bad, torch.ones(1, 8), None)


@pytest.mark.parametrize("rows,intermediate", [(1, 8), (3, 37), (2, 5)])
def test_silu_mul_kernel_matches_torch(kernels, rows, intermediate):
    """The C SiLU-and-multiply (its vectorised exp) against torch, gates from -100 to 100 (past the
    exp's clamping range at both ends), widths off the 8-lane step."""
    torch.manual_seed(rows * 10 + intermediate)
    gate = torch.linspace(-100, 100, rows * intermediate)[torch.randperm(rows * intermediate)]
    gate = gate.view(rows, intermediate)
    gu = torch.cat([gate, torch.randn(rows, intermediate)], dim=1).contiguous()
    act = torch.empty(rows, intermediate)
    kernels.decode_silu_mul(gu.data_ptr(), rows, intermediate, act.data_ptr(), 2)
    ref = torch.nn.functional.silu(gate.double()) * gu[:, intermediate:].double()
    torch.testing.assert_close(act.double(), ref, rtol=2e-6, atol=1e-6)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    paths = {"qwen3_gqa": make_qwen3(str(root / "qwen3_gqa"), shape="gqa", seed=1),  # q/k norms, GQA 4:2
             "qwen3_bias_tied": make_qwen3(str(root / "qwen3_bt"), shape="bias_tied", seed=2)}  # qkv + o bias
    for name in ("qwen2_gqa", "llama_bias", "llama3_tied"):  # qkv bias; all biases; llama3 RoPE, 1 KV head
        paths[name] = make_tiny(str(root / name), name, seed=3)
    from sliding_checkpoints import make_checkpoint
    paths["mistral"] = make_checkpoint("mistral", str(root / "mistral"))  # a window of 8 on every layer
    return paths


def generate(llm, prompts, max_tokens=10):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    return llm.generate(prompts, sp, use_tqdm=False)


@pytest.mark.parametrize("name", ["qwen3_gqa", "qwen3_bias_tied", "qwen2_gqa", "llama_bias", "llama3_tied", "mistral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_equals_eager_forward(checkpoints, name, dtype, monkeypatch):
    """Batches of up to a one-call limit (one C call per step; dense fp32 and bf16 weights take any
    batch, lowered here to 2 sequences) and above it (the per-layer path: C phases between the
    layers' own matmuls, as for a model with a layer outside C), prompts crossing KV blocks,
    prefills with and without a cached prefix (the later batches repeat the earlier prompts): the
    same tokens and logprobs as the eager forward of the same engine."""
    llm = LLM(checkpoints[name], dtype=dtype, kvcache_block_size=16, max_model_len=128,
              cpu_kvcache_bytes=1 << 24)
    try:
        runner = llm.llm_engine.model_runner
        fused = runner.step_runner(FusedDecode)
        assert isinstance(fused, cpu_decode.FusedDecode) and fused.max_rows == cpu_kernels.ALL_ROWS
        limit = fused.max_rows = 2
        calls = {"decode_layers": 0, "decode_attention_layer": 0, "rope_store_layer": 0}

        def counted(name_):
            real = getattr(fused.kernels, name_)

            def call(*args):
                calls[name_] += 1
                return real(*args)
            return call
        for name_ in calls:
            monkeypatch.setattr(fused.kernels, name_, counted(name_))
        prefix_hits = []
        real_prefill = runner.backend.prefill

        def prefill(q, k, v, k_cache, v_cache, meta, scale, **options):
            prefix_hits.append(any(k > q for q, k in zip(meta.seqlens_q, meta.seqlens_k)))  # a cached prefix
            return real_prefill(q, k, v, k_cache, v_cache, meta, scale, **options)
        monkeypatch.setattr(runner.backend, "prefill", prefill)
        prompts = [[3 + i, 9, 27 + i, 81 - i] * (2 + 3 * (i % 5)) for i in range(max(5, limit + 1))]  # 8 .. 56 tokens
        batches = [prompts[:1], prompts[1:3], prompts[:3], prompts]
        with_fused = [generate(llm, b) for b in batches]
        # Every C path ran: one call per step up to the limit, one per layer and step above, one
        # per layer and prefill step.
        num_layers = len(fused.modules)
        assert calls["decode_layers"] > 0 and calls["decode_attention_layer"] % num_layers == 0
        assert calls["decode_attention_layer"] > 0
        assert calls["rope_store_layer"] >= len(batches) * num_layers and calls["rope_store_layer"] % num_layers == 0
        assert any(prefix_hits) and not all(prefix_hits)
        runner.step_runners = []
        eager = [generate(llm, b) for b in batches]
        for fused_outs, eager_outs in zip(with_fused, eager):
            for a, b in zip(fused_outs, eager_outs):
                assert a["token_ids"] == b["token_ids"]
                for la, lb in zip(a["logprobs"], b["logprobs"]):
                    assert la.keys() == lb.keys()
                    for tok in la:
                        assert la[tok] == pytest.approx(lb[tok], abs=3e-4)  # summation order (decisive weights)
    finally:
        llm.exit()


def test_bf16_weights_are_held_in_bf16_under_fp32_activations(checkpoints):
    llm = LLM(checkpoints["qwen3_bias_tied"], dtype="bfloat16", max_model_len=64, cpu_kvcache_bytes=1 << 22)
    try:
        runner = llm.llm_engine.model_runner
        assert runner.dtype == torch.float32 and runner.kv_cache.dtype == torch.float16  # kv_cache_dtype auto
        model = runner.model
        layer = model.model.layers[0]
        assert layer.self_attn.qkv_proj.weight.dtype == torch.bfloat16
        assert layer.input_layernorm.weight.dtype == torch.float32
        # The tied table is bf16 too, and its lookups still come out fp32.
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert model.model.embed_tokens.weight.dtype == torch.bfloat16
        assert model.model.embed_tokens(torch.tensor([1, 2])).dtype == torch.float32
    finally:
        llm.exit()


def test_engine_runs_without_a_c_compiler(checkpoints, monkeypatch, tmp_path):
    """No compiler and no cached library: the torch paths run, the tokens are those of the C path."""
    llm = LLM(checkpoints["qwen3_gqa"], max_model_len=64, cpu_kvcache_bytes=1 << 22)
    try:
        assert llm.llm_engine.model_runner.step_runner(FusedDecode) is not None
        expected = [o["token_ids"] for o in generate(llm, [[5, 6, 7]])]
    finally:
        llm.exit()
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_kernels", None)
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    llm = LLM(checkpoints["qwen3_gqa"], max_model_len=64, cpu_kvcache_bytes=1 << 22)
    try:
        assert cpu_kernels.load() is None and llm.llm_engine.model_runner.step_runner(FusedDecode) is None
        assert llm.llm_engine.model_runner.backend.cpu_kernel is None
        assert [o["token_ids"] for o in generate(llm, [[5, 6, 7]])] == expected
    finally:
        llm.exit()


def test_the_avx2_build_is_forced_by_the_march_setting(other_build_cache):
    """NANOVLLM_CPU_MARCH=x86-64-v3 builds the AVX2 + FMA library (no AVX-512 register in its code:
    zmm, ymm16-31, mask registers; its own cache file) and its kernels give the same results: the
    path AVX2-only machines run."""
    import os
    import re
    import subprocess
    import sys
    code = ("import torch; from nanovllm.kernels import cpu_kernels as ck; "
            "from nanovllm.layers.quantization.unquantized import dense_c_view; k = ck.load(); "
            "w = torch.randn(37, 45).bfloat16(); x = torch.randn(3, 45); "
            "y = ck.linear(k, ck.linear_struct(k, dense_c_view(w)), x, None); "
            "assert torch.allclose(y.double(), x.double() @ w.double().T, atol=1e-5); print(ck.library_path())")
    env = {**os.environ, "NANOVLLM_CPU_MARCH": "x86-64-v3", "NANOVLLM_CACHE": str(other_build_cache)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    library = out.stdout.strip().splitlines()[-1]
    assert library.startswith(str(other_build_cache)) and os.path.isfile(library)
    if shutil.which("objdump") is not None:
        disassembly = subprocess.run(["objdump", "-d", library], capture_output=True, text=True).stdout
        assert "ymm" in disassembly and not re.search(r"zmm|ymm(1[6-9]|2[0-9]|3[01])|%k[1-7]", disassembly)
    bad = subprocess.run([sys.executable, "-c", "from nanovllm.kernels import cpu_kernels; print(cpu_kernels.load())"],
                         env={**env, "NANOVLLM_CPU_MARCH": "native; rm -rf /"}, capture_output=True, text=True)
    assert bad.stdout.strip() == "None" and "is not a -march value" in bad.stderr
