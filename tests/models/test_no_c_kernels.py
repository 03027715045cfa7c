"""The one rule without the C kernels (no C compiler, or NANOVLLM_CPU_KERNEL=0): every weight format
still runs, from a dense copy in the model dtype multiplied by torch. GGUF block formats are
dequantized once by the gguf package's reference code: the same values transformers reads from the
file, so the log-probabilities are transformers' own to fp32 rounding (the C kernels' inputs are
rounded to integers; torch's are not)."""
import logging

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from nanovllm import LLM  # noqa: E402
from nanovllm.kernels import cpu_kernels  # noqa: E402
from nanovllm.layers.quantization import LinearKernels, OnlineQuantConfig, linear_layers  # noqa: E402
from nanovllm.layers.quantization.moe_ops import experts_reference, select_experts  # noqa: E402


@pytest.fixture
def no_c_kernels(monkeypatch):
    """As where no C compiler exists: load() gives None (what it returns after a failed build)."""
    from nanovllm.layers.quantization import gguf_dense
    monkeypatch.setattr(cpu_kernels, "_tried", True)
    monkeypatch.setattr(cpu_kernels, "_kernels", None)
    monkeypatch.setattr(gguf_dense, "_said", False)


@pytest.mark.parametrize("case", ["llama-q4_k_m", "qwen2-mixed"])
def test_gguf_files_run_dequantized(tmp_path, case, no_c_kernels, caplog):
    from gguf_helpers import CASES, hf_logprobs_of_file, logprob_errors, model_of, our_logprobs, write_tiny
    arch, types = CASES[case]
    path = write_tiny(tmp_path / f"{case}.gguf", arch, types, layers=1)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 320, 24)]
    ref = hf_logprobs_of_file(path, prompt)
    with caplog.at_level(logging.WARNING, logger="nanovllm"), \
            LLM(str(path), max_num_seqs=2, max_model_len=64, enforce_eager=True, kv_cache_dtype="float32") as llm:
        methods = [layer.quant_method for layer in linear_layers(model_of(llm))]
        ours = our_logprobs(llm, prompt, 320)
    assert all(m.dense is not None and "dequantized, torch" in m.name for m in methods if hasattr(m, "dense"))
    said = [r for r in caplog.records if "dequantized once" in r.getMessage()]
    assert len(said) == 1 and "no C kernels here" in said[0].getMessage()  # said once, for every layer
    assert logprob_errors(ours, ref, prompt).mean() < 1e-4


def test_quantized_experts_run_dequantized(no_c_kernels):
    """A MoE layer quantized at load: the grouped torch loop over the dequantized blocks, exactly."""
    from nanovllm.layers.moe import FusedMoE
    torch.manual_seed(0)
    layer = FusedMoE(6, 2, 64, 96, True, OnlineQuantConfig("q8_0"), "mlp.experts")
    dense13, dense2 = torch.randn(6, 192, 64) * 0.1, torch.randn(6, 64, 96) * 0.1
    layer.w13_weight.data.copy_(dense13)
    layer.w2_weight.data.copy_(dense2)
    layer.quant_method.process_weights_after_loading(layer, LinearKernels(), False)
    assert "dequantized, torch" in layer.quant_method.name
    q8 = gguf.GGMLQuantizationType.Q8_0
    deq = [torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), q8), q8)) for w in (dense13, dense2)]
    x, logits = torch.randn(5, 64), torch.randn(5, 6)
    weights, ids = select_experts(logits, 2, True)
    torch.testing.assert_close(layer(x, logits), experts_reference(x, deq[0], deq[1], weights, ids))


def test_mxfp4_experts_with_biases_run_dequantized(tmp_path, no_c_kernels):
    """GPT-OSS's MXFP4 experts (biases, clamped SwiGLU) through the grouped torch loop: transformers'
    greedy tokens."""
    from helpers import check_tokens_close, hf_greedy
    from nanovllm import SamplingParams
    from mxfp4_checkpoints import make_mxfp4_checkpoint
    from transformers import Mxfp4Config
    path = make_mxfp4_checkpoint(str(tmp_path))
    prompts = [[5, 17, 99, 3, 42, 8, 8, 130], [200, 3]]
    ref = hf_greedy(path, prompts, 12, quantization_config=Mxfp4Config(dequantize=True))
    with LLM(path, dtype="float32", cpu_kvcache_bytes=8 << 20) as llm:
        experts = llm.llm_engine.model_runner.model.model.layers[0].mlp.experts
        assert "dequantized, torch" in experts.quant_method.name
        ours = [o["token_ids"] for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                                             ignore_eos=True), use_tqdm=False)]
    assert check_tokens_close(ours, ref) == len(prompts)
