"""quantization="q8_0" | "q4_0" | "q4_k" | "mxfp4" on a safetensors checkpoint: the blocks held bit-identical to
gguf.quants.quantize of the checkpoint's weights (gguf has no Q4_K quantizer: ours is checked through
gguf's own Q4_K dequantization), and the model's log-probabilities against transformers running the
same weights through gguf's quantize / dequantize."""
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from helpers import make_qwen3  # noqa: E402
from nanovllm import LLM  # noqa: E402
from nanovllm.kernels import cpu_kernels  # noqa: E402
from gguf_helpers import model_of, our_logprobs  # noqa: E402


def format_of(w: np.ndarray, fmt: str) -> str:
    """q4_k falls back to q5_0 where the inputs are not whole blocks of 256 (llama-quantize's rule)."""
    return "q5_0" if fmt == "q4_k" and w.shape[1] % 256 else fmt


def quantized(w: np.ndarray, fmt: str) -> np.ndarray:
    """The blocks the engine should hold: gguf.quants' (q8_0, q4_0, q5_0), ours for q4_k (gguf.quants
    has no Q4_K quantizer; its layout is checked through gguf's dequantization)."""
    fmt = format_of(w, fmt)
    if fmt == "q4_k":
        from nanovllm.layers.quantization.quantizers import quantize_q4_k
        return quantize_q4_k(w)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[fmt.upper()])


def test_our_q4_k_blocks_are_gguf_blocks():
    """gguf's own Q4_K dequantization of our blocks: closer to the input than gguf's Q4_1 (5 bits a
    weight, Q4_K's 4.5) and Q4_0 quantizers manage, an outlier column included; at most 16 levels in
    each sub-block of 32 (its d sc q - dmin m)."""
    from nanovllm.layers.quantization.quantizers import quantize_q4_k
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 512)) * 0.02).astype(np.float32)
    x[:, 7] *= 20
    ours = gguf.quants.dequantize(quantize_q4_k(x), gguf.GGMLQuantizationType.Q4_K).reshape(x.shape)

    def rmse(fmt):
        qt = gguf.GGMLQuantizationType[fmt]
        return np.sqrt(np.mean((gguf.quants.dequantize(gguf.quants.quantize(x, qt), qt) - x) ** 2))
    err = np.sqrt(np.mean((ours - x) ** 2))
    assert err < rmse("Q4_1") < rmse("Q4_0"), (err, rmse("Q4_1"), rmse("Q4_0"))
    sub = ours.reshape(64, -1, 32)
    assert max(len(np.unique(s)) for s in sub.reshape(-1, 32)) <= 16
    with pytest.raises(ValueError, match="whole blocks of 256"):
        quantize_q4_k(x[:, :100])


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k", "mxfp4"])
def test_online_quantization(tmp_path, fmt):
    size = dict(hidden_size=256, intermediate_size=512) if fmt == "q4_k" else dict(hidden_size=128, intermediate_size=256)
    folder = make_qwen3(str(tmp_path / "qwen3"), shape="gqa", seed=3, tie_word_embeddings=True, **size)
    from safetensors.torch import load_file
    state = {}
    for f in Path(folder).glob("*.safetensors"):
        state.update(load_file(str(f)))
    qt = gguf.GGMLQuantizationType[fmt.upper()]
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 256, 30)]
    # (14-bit inputs: the check is of the blocks; test_input_rounding_is_the_named_one checks the roundings)
    with LLM(folder, quantization=fmt, max_num_seqs=4, max_model_len=128, cpu_input_bits=14) as llm:
        model = model_of(llm)
        kernels = cpu_kernels.load()

        def held_as(blocks: np.ndarray) -> np.ndarray:
            """The blocks in the 8-row interleaved layout the layers hold them in (where there is one)."""
            block_size, block_bytes = gguf.GGML_QUANT_SIZES[qt]
            packed = cpu_kernels.interleaved(kernels, fmt, torch.from_numpy(blocks), blocks.shape[1] // block_bytes * block_size)
            return blocks if packed is None else packed[1].numpy()
        down = model.model.layers[0].mlp.down_proj
        assert [t for t, _, _ in down.weight.c_parts] == [f"{fmt}x8"]
        o_proj = model.model.layers[0].self_attn.o_proj  # 128 inputs: q4_k's fallback, q5_0
        assert o_proj.quant_method.types == [format_of(np.zeros((1, o_proj.input_size)), fmt)]
        want = quantized(state["model.layers.0.mlp.down_proj.weight"].float().numpy(), fmt)
        assert np.array_equal(down.weight.numpy(), held_as(want))  # bit-identical blocks
        qkv = model.model.layers[1].self_attn.qkv_proj.weight.numpy()
        ref = np.concatenate([quantized(state[f"model.layers.1.self_attn.{p}_proj.weight"].float().numpy(), fmt)
                              for p in "qkv"])
        assert np.array_equal(qkv, held_as(ref))
        table = model.model.embed_tokens.weight
        assert table.dtype == torch.uint8 and model.lm_head.weight is table  # tied: one quantized table
        ours = our_logprobs(llm, prompt, 256)
    # The reference: transformers with every weight we quantize replaced by gguf's dequantization
    # of gguf's quantization of it, so that only our inputs' rounding differs.
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for module in hf.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                w = module.weight.detach().numpy()
                held_qt = gguf.GGMLQuantizationType[format_of(w, fmt).upper()]
                module.weight.copy_(torch.from_numpy(gguf.quants.dequantize(quantized(w, fmt), held_qt).reshape(w.shape)))
        ref_lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    err = np.mean([abs(ours[j, prompt[j + 1]].item() - ref_lp[j, prompt[j + 1]].item()) for j in range(len(prompt) - 1)])
    print(fmt, "mean |logprob error|", err)
    assert err < 0.03, err
