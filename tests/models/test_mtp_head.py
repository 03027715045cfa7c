"""The hybrids' multi-token-prediction head (models/qwen3_next.py, MtpHeadMixin): a tiny Qwen3.5 /
Qwen3.5-MoE checkpoint given an `mtp.*` head (its layer one of transformers' own decoder layers, of
the full-attention kind, at the index after the target's), loaded as the proposer seat would, against
the head computed from transformers' modules: fc over the two normed inputs, that layer, the norm."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import check_tokens_close, hf_greedy
from nanovllm.layers.backends.torch_backend import TorchBackend, TorchMetadata
from nanovllm.layers.attention import Attention
from nanovllm.loader.safetensors import safetensors_weights
from nanovllm.models import get_mtp_head_class
from nanovllm.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeMTP, Qwen3_5MTP
from nanovllm.utils.context import Context, forward_context

from hybrid_checkpoints import MAX_NEW, generate, make_checkpoint, prompts, write_gguf


def add_mtp_head(path: str, family: str) -> tuple[dict, object]:
    """Write an MTP head into the checkpoint at path; return its tensors and the reference modules."""
    import transformers
    from transformers.models import qwen3_5, qwen3_5_moe
    module = {"qwen3_5": qwen3_5.modeling_qwen3_5, "qwen3_5_moe": qwen3_5_moe.modeling_qwen3_5_moe}[family]
    config_path = Path(path) / "config.json"
    raw = json.loads(config_path.read_text())
    config = transformers.AutoConfig.from_pretrained(path)
    # the head's layer at index num_hidden_layers, of the full-attention kind
    config.layer_types = list(config.layer_types) + ["full_attention"]
    config._attn_implementation = "sdpa"
    torch.manual_seed(7)
    prefix = "Qwen3_5Moe" if family == "qwen3_5_moe" else "Qwen3_5"
    layer = getattr(module, f"{prefix}DecoderLayer")(config, config.num_hidden_layers).eval()
    norm_cls = getattr(module, f"{prefix}RMSNorm")
    norms = {n: norm_cls(config.hidden_size, eps=config.rms_norm_eps) for n in ("e", "h", "out")}
    for norm in norms.values():
        torch.nn.init.normal_(norm.weight, std=0.3)
    for p in layer.parameters():  # the layer's norms too: zeros would hide a wrong (1 + w)
        torch.nn.init.normal_(p, std=0.3 if p.dim() == 1 else 0.1)
    fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
    head = {"mtp.fc.weight": fc.weight, "mtp.norm.weight": norms["out"].weight,
            "mtp.pre_fc_norm_embedding.weight": norms["e"].weight, "mtp.pre_fc_norm_hidden.weight": norms["h"].weight}
    for k, v in layer.state_dict().items():
        if k == "mlp.experts.gate_up_proj":  # as checkpoints hold them: per expert, gate rows first
            for e, rows in enumerate(v):
                gate, up = rows.chunk(2)
                head[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = gate
                head[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = up
        elif k == "mlp.experts.down_proj":
            head.update({f"mtp.layers.0.mlp.experts.{e}.down_proj.weight": w for e, w in enumerate(v)})
        else:
            head[f"mtp.layers.0.{k}"] = v
    head = {k: v.detach().float().contiguous() for k, v in head.items()}
    file = next(Path(path).glob("*.safetensors"))
    save_file({**load_file(str(file)), **head}, str(file), metadata={"format": "pt"})
    config_path.write_text(json.dumps({**raw, "mtp_num_hidden_layers": 1}))
    return head, (config, layer, norms, fc)


def reference(path: str, modules, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The head's output from transformers' modules (the target's embedding and rotary embedding)."""
    import transformers
    config, layer, norms, fc = modules
    target = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n = input_ids.shape[0]
    with torch.no_grad():
        x = fc(torch.cat([norms["e"](target.get_input_embeddings()(input_ids)), norms["h"](hidden)], -1))[None]
        positions = torch.arange(n).view(1, 1, -1).expand(3, 1, -1)
        cos_sin = target.model.rotary_emb(x, positions)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        return norms["out"](layer(x, position_embeddings=cos_sin, attention_mask=mask))[0]


@pytest.mark.parametrize("family,model_class", [("qwen3_5", Qwen3_5MTP), ("qwen3_5_moe", Qwen3_5MoeMTP)])
def test_mtp_head_loads_and_matches_transformers(tmp_path, family, model_class):
    path = make_checkpoint(family, str(tmp_path / "ckpt"))
    head, modules = add_mtp_head(path, family)
    import transformers
    config = transformers.AutoConfig.from_pretrained(path)
    assert get_mtp_head_class(config) is model_class  # what the proposer seat builds for this target
    model = model_class(config)
    model.load_weights(safetensors_weights(path))
    params = dict(model.named_parameters())
    assert torch.equal(params["model.fc.weight"], head["mtp.fc.weight"])  # loaded, not left random
    for m in model.modules():
        if isinstance(m, Attention):
            m.backend = TorchBackend("cpu")
    n = 11
    torch.manual_seed(0)
    input_ids, hidden = torch.randint(3, config.vocab_size, (n,)), torch.randn(n, config.hidden_size)
    with torch.no_grad(), forward_context(Context(is_prefill=True,
                                                  attn_metadata=TorchMetadata(seqlens_q=[n], seqlens_k=[n]))):
        ours = model(input_ids, torch.arange(n), hidden)
        logits = model.compute_logits(ours)
    want = reference(path, modules, input_ids, hidden)
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)
    assert logits.shape == (n, config.vocab_size)


def test_the_target_skips_the_head_and_a_checkpoint_without_one_is_named(tmp_path):
    import transformers
    path = make_checkpoint("qwen3_5", str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="no MTP head"):
        Qwen3_5MTP(transformers.AutoConfig.from_pretrained(path))
    with pytest.raises(ValueError, match="no MTP head model for architecture Qwen3ForCausalLM"):
        get_mtp_head_class(transformers.Qwen3Config(architectures=["Qwen3ForCausalLM"]))
    add_mtp_head(path, "qwen3_5")
    target = Qwen3_5ForCausalLM(transformers.AutoConfig.from_pretrained(path))
    target.load_weights(safetensors_weights(path))  # the mtp.* tensors are not the target's: no error
    assert not any(name.startswith("mtp") or ".fc." in name for name, _ in target.named_parameters())


@pytest.mark.parametrize("family,arch", [("qwen3_5", "qwen35"), ("qwen3_5_moe", "qwen35moe")])
def test_a_gguf_file_with_the_head(tmp_path, family, arch):
    """llama.cpp's converter writes the head as one more layer (nextn_predict_layers; its fc and norms
    blk.N.nextn.*): the target runs as the checkpoint (transformers' greedy tokens), and the head
    read from the file holds the checkpoint's head."""
    pytest.importorskip("gguf")
    from nanovllm.loader.gguf import GGUFFile
    path = make_checkpoint(family, str(tmp_path / "ckpt"))
    head, _ = add_mtp_head(path, family)
    file = write_gguf(path, str(tmp_path / "f32.gguf"), arch)
    ours, _ = generate(file, prompts())
    assert check_tokens_close(ours, hf_greedy(path, prompts(), MAX_NEW, mask_eos=False)) == len(prompts())
    gguf_file = GGUFFile(file)
    config = gguf_file.hf_config()
    assert config.num_hidden_layers == 4 and config.mtp_num_hidden_layers == 1
    from_file = get_mtp_head_class(config)(config)
    from_file.load_weights(gguf_file.weights())
    import transformers
    from_ckpt = get_mtp_head_class(transformers.AutoConfig.from_pretrained(path))(
        transformers.AutoConfig.from_pretrained(path))
    from_ckpt.load_weights(safetensors_weights(path))
    want = dict(from_ckpt.named_parameters())
    for name, param in from_file.named_parameters():
        torch.testing.assert_close(param, want[name], rtol=0, atol=1e-6, msg=name)
