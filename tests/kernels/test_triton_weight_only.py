"""The Triton weight-only kernel (kernels/triton_weight_only.py) against x @ W^T of the weight its
format defines (weight_only.QuantizedWeight.dequantize, itself checked exactly against each format's
definition in test_prequantized.py), for 4-bit / 8-bit integers with and without zero points, groups
in order and scattered (g_idx), and fp8; under the Triton interpreter on CPU (compiled on CUDA)."""
import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from nanovllm.kernels.triton_weight_only import pack, weight_only_linear  # noqa: E402
from nanovllm.layers.quantization.weight_only import QuantizedWeight  # noqa: E402

CASES = {  # name -> (value range, with zero points, group, scattered groups, fp8)
    "int4-sym-g32": ((-8, 8), False, 32, False, False),
    "int4-zeros-g64-g_idx": ((0, 16), True, 64, True, False),
    "int8-sym-channel": ((-128, 128), False, None, False, False),
    "int8-zeros-g32": ((-128, 128), True, 32, False, False),
    "fp8-g64": (None, False, 64, False, True),
}


def weight(case: str, n: int, k: int, seed: int) -> QuantizedWeight:
    (span, has_zeros, group, scattered, fp8), g = CASES[case], torch.Generator().manual_seed(seed)
    group = group or k
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    g_idx = torch.randperm(k, generator=g) // group if scattered else None
    if fp8:
        values = (torch.randn(n, k, generator=g) * 50).to(torch.float8_e4m3fn)
        return QuantizedWeight(values, scales, group)
    values = torch.randint(*span, (n, k), generator=g, dtype=torch.int32)
    zeros = torch.randint(*span, (n, k // group), generator=g, dtype=torch.int32) if has_zeros else None
    return QuantizedWeight(values, scales, group, zeros, g_idx)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("m", [1, 5, 33])
def test_kernel_equals_the_dequantized_matmul(case, m):
    n, k = 80, 192  # neither a multiple of the 64-output tile, nor k of every group
    qw = weight(case, n, k, seed=m)
    packed = pack(qw.values, qw.scales, qw.group, qw.zeros, qw.g_idx)
    assert packed.bits == (4 if case.startswith("int4") else 8)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7))
    ref = x.double() @ qw.dequantize().double().t()
    for name in ("q", "scales", "zeros", "g_idx"):
        t = getattr(packed, name)
        if t is not None:
            setattr(packed, name, t.to(DEVICE))
    got = weight_only_linear(x.to(DEVICE), packed).cpu().double()
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item()), (got - ref).abs().max()


# ---- GGUF block formats on the Triton kernel (layers/quantization/gguf_triton.py) ----------------
GGUF_TYPES = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q6_k", "mxfp4", "q2_k", "q3_k", "iq4_nl", "iq4_xs",
              "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m"]
# held as 8-bit values (the rest 4-bit)
EIGHT_BITS = ("q8_0", "q5_0", "q5_1", "q6_k", "iq4_nl", "iq4_xs", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s",
              "iq1_s", "iq1_m")
# fp32 products: exact under the interpreter, TF32 (10-bit mantissas) in tl.dot on a GPU
GGUF_RTOL = 1e-4 if DEVICE == "cpu" else 5e-3


@pytest.mark.parametrize("name", GGUF_TYPES)
def test_gguf_blocks_unpacked_and_multiplied(name):
    """Each GGUF format's blocks unpacked into the kernel's layout: the weights are the gguf
    package's dequantization of the same blocks, exactly; the kernel's product is x @ those^T; an
    embedding's rows read back from the packed form are those rows."""
    import numpy as np
    gguf = pytest.importorskip("gguf")
    from helpers import qtype, random_weights
    from nanovllm.layers.quantization import gguf_triton
    n, k = 40, 512
    raw = random_weights(name, n, k, np.random.default_rng(3))
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype(name)).reshape(n, k).astype(np.float32))
    assert torch.equal(gguf_triton.dequantize(torch.from_numpy(raw), name, k), want)
    held = gguf_triton.hold(torch.from_numpy(raw).to(DEVICE), name, k, torch.float32)
    assert held.bits == (8 if name in EIGHT_BITS else 4)
    assert (held.mins is not None) == (name in ("q4_1", "q5_1", "q4_k", "q2_k"))
    assert held.fp4 == (name == "mxfp4")  # MXFP4 held as its 4-bit codes
    for m in (1, 7):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        ref = x.double() @ want.double().t()
        got = gguf_triton.linear([held], x.to(DEVICE), None).cpu().double()
        assert torch.allclose(got, ref, rtol=GGUF_RTOL, atol=GGUF_RTOL * ref.abs().max().item()), (got - ref).abs().max()
    ids = torch.tensor([5, 0, 39, 5])
    np.testing.assert_allclose(gguf_triton.rows(held, ids.to(DEVICE)).cpu().numpy(), want[ids].numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", ["llama-q4_k_m", "qwen2-mixed", "qwen3-q4_0", "llama-k-low", "llama-iq"])
def test_gguf_file_on_the_triton_kernel_matches_transformers(tmp_path, monkeypatch, case):
    """A whole GGUF model on the Triton kernel (what a GPU runs; here NANOVLLM_TRITON_WEIGHT_ONLY=1
    under the interpreter): Q4_K / Q6_K parts chained in one layer and a Q4_K tied table; every
    32-weight format with F16 / BF16 layers beside them and a Q6_K table; Q4_0 with its own LM head.
    transformers' log-probabilities on the same file, to fp32 rounding (the kernel's inputs are not
    quantized)."""
    pytest.importorskip("gguf")
    import numpy as np
    from gguf_helpers import CASES, hf_logprobs_of_file, logprob_errors, model_of, our_logprobs, write_tiny
    from nanovllm.layers.quantization import linear_layers
    from nanovllm import LLM
    monkeypatch.setenv("NANOVLLM_TRITON_WEIGHT_ONLY", "1")
    arch, types = CASES[case]
    shape = dict(heads=2, kv_heads=1, untied=True) if arch == "qwen3" else {}
    path = write_tiny(tmp_path / "tiny.gguf", arch, types, layers=1, **shape)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 320, 12)]
    ref = hf_logprobs_of_file(path, prompt)
    with LLM(str(path), max_num_seqs=2, max_model_len=64, enforce_eager=True, kv_cache_dtype="float32") as llm:
        names = {layer.quant_method.name for layer in linear_layers(model_of(llm))}
        assert all(m.triton_parts is not None for m in (layer.quant_method for layer in linear_layers(model_of(llm)))), names
        ours = our_logprobs(llm, prompt, 320)
    assert logprob_errors(ours, ref, prompt).mean() < (1e-4 if DEVICE == "cpu" else 2e-2)


def test_gpt_oss_mxfp4_experts_on_the_triton_kernel_match_transformers(tmp_path, monkeypatch):
    """GPT-OSS as OpenAI ships it, its experts held as MXFP4 codes and multiplied by the Triton
    experts kernel (kernels/fused_moe.py, what a GPU runs; here under the interpreter) with their
    biases and clamped SwiGLU: transformers' greedy tokens (reading the same blocks dequantized)."""
    pytest.importorskip("gguf")
    from transformers import Mxfp4Config
    from mxfp4_checkpoints import make_mxfp4_checkpoint
    from sliding_checkpoints import check_greedy_against_transformers
    from nanovllm.layers.moe import FusedMoE
    monkeypatch.setenv("NANOVLLM_TRITON_WEIGHT_ONLY", "1")
    path = make_mxfp4_checkpoint(str(tmp_path / "gpt_oss"))
    from nanovllm import LLM
    with LLM(path, dtype="float32", enforce_eager=True, cpu_kvcache_bytes=1 << 20) as llm:
        experts = [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, FusedMoE)]
        held = experts[0].quant_method.triton_experts
        assert held is not None and held[0].fp4 and held[0].bits == 4 and held[0].group == 32
        assert experts[0].w13_weight.numel() == 0  # the raw rows dropped: held once, as codes
    check_greedy_against_transformers(path, dict(enforce_eager=True), 10,
                                      quantization_config=Mxfp4Config(dequantize=True))
