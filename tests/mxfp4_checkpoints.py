"""A tiny GPT-OSS checkpoint with MXFP4 experts, as OpenAI's release stores them."""
import json
import os
import numpy as np
import pytest
import torch


gguf = pytest.importorskip("gguf")


safetensors_torch = pytest.importorskip("safetensors.torch")


VOCAB, MAX_NEW = 256, 24


def ocp_pair(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [E, rows, k] as OCP MXFP4 (blocks uint8 [E, rows, k / 32, 16], scales uint8
    [E, rows, k / 32]), quantized by gguf.quants (whose blocks hold values j and j + 16 in byte
    j's nibbles; the OCP layout holds values 2j and 2j + 1)."""
    e, rows, k = dense.shape
    raw = gguf.quants.quantize(dense.float().reshape(-1, k).numpy(), gguf.GGMLQuantizationType.MXFP4)
    blocks = raw.reshape(e, rows, k // 32, 17)
    codes = np.concatenate([blocks[..., 1:] & 0x0F, blocks[..., 1:] >> 4], -1)  # [..., 32] in order
    ocp = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.from_numpy(np.ascontiguousarray(ocp)), torch.from_numpy(np.ascontiguousarray(blocks[..., 0]))


def make_mxfp4_checkpoint(path: str) -> str:
    import transformers

    from sliding_checkpoints import COMMON, WINDOW
    from helpers import save_decisive
    shape = {k: v for k, v in COMMON.items() if k != "intermediate_size"}
    config = transformers.GptOssConfig(
        **shape, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=False)
    config.architectures = ["GptOssForCausalLM"]
    torch.manual_seed(11)
    model = transformers.GptOssForCausalLM(config)
    save_decisive(model, path, VOCAB)
    file = os.path.join(path, "model.safetensors")
    tensors = safetensors_torch.load_file(file)
    for name in [n for n in tensors if n.endswith("mlp.experts.gate_up_proj") or n.endswith("mlp.experts.down_proj")]:
        # stored [E, inputs, outputs]; the blocks run along the inputs of each output row
        blocks, scales = ocp_pair(tensors.pop(name).transpose(1, 2))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    safetensors_torch.save_file(tensors, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path

