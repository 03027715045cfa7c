"""The Triton fused-experts kernel (kernels/fused_moe.py) against the grouped torch loop
(layers/moe.py, experts_reference, itself checked against transformers in test_moe.py), for random
routings with experts that receive no token, under the Triton interpreter on CPU (compiled on
CUDA); and the pair alignment it is built on, by a hand count."""
import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from nanovllm.kernels.fused_moe import align_pairs, fused_experts  # noqa: E402
from nanovllm.layers.quantization.moe_ops import experts_reference, select_experts  # noqa: E402


def routing(tokens: int, num_experts: int, top_k: int, seed: int, unused: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=g)
    if unused:
        logits[:, num_experts - unused:] -= 100.0  # the last experts receive no token
    weights, ids = select_experts(logits, top_k, renormalize=seed % 2 == 0)
    return weights.to(DEVICE), ids.to(DEVICE), g


@pytest.mark.parametrize("tokens,num_experts,top_k,unused", [(1, 8, 2, 0), (5, 8, 3, 3), (33, 6, 2, 1), (64, 16, 4, 6)])
def test_align_pairs_groups_each_block_by_one_expert(tokens, num_experts, top_k, unused):
    _, ids, _ = routing(tokens, num_experts, top_k, seed=tokens, unused=unused)
    block_m = 16
    sorted_pairs, block_experts = align_pairs(ids, num_experts, block_m)
    pairs = tokens * top_k
    flat = ids.flatten().cpu()
    real = sorted_pairs.cpu()
    assert sorted(real[real < pairs].tolist()) == list(range(pairs))  # every pair once
    for b, expert in enumerate(block_experts.cpu().tolist()):
        block = real[b * block_m:(b + 1) * block_m]
        block = block[block < pairs]
        if expert < 0:
            assert block.numel() == 0
        else:
            assert (flat[block] == expert).all()
    counts = torch.bincount(flat, minlength=num_experts)
    assert (block_experts >= 0).sum().item() == int(((counts + block_m - 1) // block_m).sum())
    for e in range(num_experts - unused, num_experts):
        assert e not in block_experts.tolist()


@pytest.mark.parametrize("tokens,num_experts,top_k,unused", [(1, 8, 2, 0), (7, 8, 3, 3), (40, 6, 2, 1)])
def test_fused_experts_equal_the_grouped_torch_loop(tokens, num_experts, top_k, unused):
    weights, ids, g = routing(tokens, num_experts, top_k, seed=tokens + 1, unused=unused)
    hidden, inter = 32, 48  # 48: not a power of two, so the kernels' output masks matter
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2).to(DEVICE)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) * 0.2).to(DEVICE)
    expected = experts_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 on the compiled kernel only")
def test_fused_experts_bf16_on_cuda():
    weights, ids, g = routing(128, 64, 8, seed=3, unused=8)
    x = torch.randn(128, 256, generator=g).to(DEVICE, torch.bfloat16)
    w13 = (torch.randn(64, 2 * 384, 256, generator=g) * 0.05).to(DEVICE, torch.bfloat16)
    w2 = (torch.randn(64, 256, 384, generator=g) * 0.05).to(DEVICE, torch.bfloat16)
    expected = experts_reference(x.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids).float(), expected, rtol=3e-2, atol=3e-2)


def quantized_experts(w: torch.Tensor, type_name: str):
    """(the experts packed as the GPU holds them, their dequantized fp32 values by gguf.quants):
    quantize_rows writes each expert's rows (gguf.quants' quantizer; ours for Q4_K, which it lacks),
    gguf_triton.hold unpacks them."""
    gguf = pytest.importorskip("gguf")
    from nanovllm.kernels.triton_weight_only import stack_experts
    from nanovllm.layers.quantization.gguf_triton import hold
    from nanovllm.layers.quantization.quantizers import quantize_rows
    qtype = getattr(gguf.GGMLQuantizationType, type_name.upper())
    raws = [quantize_rows(w[e], type_name).contiguous() for e in range(w.shape[0])]
    values = torch.stack([torch.from_numpy(gguf.quants.dequantize(r.numpy(), qtype)).reshape(w.shape[1:]).float()
                          for r in raws])
    packed = stack_experts([hold(r.to(DEVICE), type_name, w.shape[2], torch.float32) for r in raws])
    return packed, values.to(DEVICE)


@pytest.mark.parametrize("type_name", ["mxfp4", "q4_0", "q8_0", "q4_k"])
def test_block_format_experts_with_biases_and_gpt_oss_activation(type_name):
    """Experts held as stored (MXFP4: GPT-OSS's) against the grouped torch loop over the values
    gguf dequantizes, with GPT-OSS's biases and clamped SwiGLU."""
    from nanovllm.layers.moe import ExpertActivation
    from nanovllm.layers.quantization.moe_ops import activate
    tokens, num_experts, top_k = 9, 4, 2
    weights, ids, g = routing(tokens, num_experts, top_k, seed=5, unused=1)
    hidden, inter = 256, 256  # whole blocks of 256 for the K-quant
    x = torch.randn(tokens, hidden, generator=g)
    w13, w13_values = quantized_experts(torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2, type_name)
    w2, w2_values = quantized_experts(torch.randn(num_experts, hidden, inter, generator=g) * 0.2, type_name)
    biases = (torch.randn(num_experts, 2 * inter, generator=g).to(DEVICE), torch.randn(num_experts, hidden, generator=g).to(DEVICE))
    act = ExpertActivation("swigluoai", 1.702, 7.0)
    x = x.to(DEVICE)
    expected = experts_reference(x, w13_values, w2_values, weights, ids, biases, act)
    got = fused_experts(x, w13, w2, weights, ids, biases, lambda gate, up: activate(gate, up, act))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)
    # A wrong nibble order or scale would move the outputs far past that.
    assert not torch.allclose(experts_reference(x, w13_values.flip(-1), w2_values, weights, ids, biases, act),
                              expected, atol=1e-1)
