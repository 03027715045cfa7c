"""GGUF files of the hybrid linear-attention families (llama.cpp's `qwen35`, `qwen35moe`,
`qwen3next`): their tensor names, their settings and the few values llama.cpp's converter stores
otherwise than the HF checkpoint (loader/gguf.py calls these).

What the converter changes: every RMSNorm but the linear layers' gated one is stored as 1 + w;
A_log as A = -exp(A_log) (ssm_a); dt_bias as ssm_dt.bias; the conv kernel squeezed to [channels,
kernel]; Qwen3-Next's interleaved in_proj_qkvz cut into attn_qkv and attn_gate; and where a key head
serves several value heads, the value heads reordered from grouped by key head to tiled (value head
h uses key head h mod num_key_heads), in every tensor that has them. Rather than move quantized
rows and columns back, the model is told the order (`linear_value_head_order: "tiled"`,
layers/gated_deltanet.py).

The converter also writes a checkpoint's MTP head (`mtp.*`, unless `--no-mtp`) as layers after the
target's: `{arch}.nextn_predict_layers` of the `block_count` layers are the head's, its decoder
layer under the usual names and its fc and norms as `blk.N.nextn.*`. Those are read back as the
checkpoint's `mtp.*` tensors (the target skips them; models/qwen3_next.py's MtpHeadMixin loads them)."""
import dataclasses
import re

import torch

ARCHITECTURES = {"qwen35": "Qwen3_5ForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM",
                 "qwen3next": "Qwen3NextForCausalLM"}
LAYER_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight", "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight", "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias", "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}


# The MTP head's own tensors (blk.N.nextn.*, N its first layer) and the checkpoint's names for them.
MTP_NAMES = {"nextn.eh_proj.weight": "fc.weight", "nextn.enorm.weight": "pre_fc_norm_embedding.weight",
             "nextn.hnorm.weight": "pre_fc_norm_hidden.weight", "nextn.shared_head_norm.weight": "norm.weight"}


def mtp_layers(file, a: str) -> int:
    """How many of the file's layers are an MTP head's (the last ones)."""
    n = int(file.field(f"{a}.nextn_predict_layers", 0) or 0)
    if not 0 <= n < int(file.field(f"{a}.block_count")):
        raise ValueError(f"{file.path!r}: {a}.nextn_predict_layers is {n}, beside {a}.block_count "
                         f"{file.field(f'{a}.block_count')}")
    return n


def mtp_name(layer: re.Match | None, hf: str | None, first: int) -> str | None:
    """The checkpoint name of a tensor of the MTP head's layers (those from `first`; layer: its name's
    match of blk.<index>.<rest>, None for a tensor outside the layers), else hf as given."""
    if layer is None or int(layer.group(1)) < first:
        return hf
    if layer.group(2) in MTP_NAMES:
        return "mtp." + MTP_NAMES[layer.group(2)]
    if hf is None:
        return None
    return f"mtp.layers.{int(layer.group(1)) - first}." + hf.split(".", 3)[3]


def hybrid_config(file, a: str, kwargs: dict) -> dict:
    """The linear layers' settings, the layer kinds and the partial rotary from a file's metadata."""
    layers = kwargs["num_hidden_layers"]
    k_heads, v_heads = int(file.field(f"{a}.ssm.group_count")), int(file.field(f"{a}.ssm.time_step_rank"))
    recurrent = file.field(f"{a}.attention.recurrent_layers", None)
    if recurrent is not None:
        kinds = ["linear_attention" if r else "full_attention" for r in list(recurrent)[:layers]]
    else:
        interval = int(file.field(f"{a}.full_attention_interval", 4))
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    rotary = int(file.field(f"{a}.rope.dimension_count", kwargs["head_dim"]))
    out = dict(layer_types=kinds, mtp_num_hidden_layers=mtp_layers(file, a),
               linear_conv_kernel_dim=int(file.field(f"{a}.ssm.conv_kernel")),
               linear_key_head_dim=int(file.field(f"{a}.ssm.state_size")), linear_num_key_heads=k_heads,
               linear_num_value_heads=v_heads,
               linear_value_head_dim=int(file.field(f"{a}.ssm.inner_size")) // v_heads,
               linear_value_head_order="tiled" if k_heads != v_heads else "grouped",
               rope_parameters={"rope_type": "default", "rope_theta": kwargs.pop("rope_theta"),
                                "partial_rotary_factor": rotary / kwargs["head_dim"]})
    return out


def stored_as_hf(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A float tensor of one of these files as the HF checkpoint holds it."""
    if name.endswith("linear_attn.A_log"):
        return torch.log(-tensor)  # stored as A = -exp(A_log)
    if name.endswith("conv1d.weight"):
        return tensor.unsqueeze(1)  # [channels, 1, kernel]
    if (name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")) \
            or name.startswith("mtp.pre_fc_norm_"):
        return tensor - 1.0  # stored as 1 + w
    return tensor


def split_rows(file, name: str, info):
    """(HF name, info) pairs of one file tensor: attn_qkv as its q, k and v rows (the model splits
    them over ranks apart, models/qwen3_next.py); any other tensor as itself."""
    if not name.endswith(".in_proj_qkv.weight"):
        return [(name, info)]
    a = file.arch
    key_total = int(file.field(f"{a}.ssm.group_count")) * int(file.field(f"{a}.ssm.state_size"))
    sizes = {"q": key_total, "k": key_total, "v": info.shape[0] - 2 * key_total}
    return row_parts(name[: -len("qkv.weight")], info, sizes)


def row_parts(base: str, info, sizes: dict[str, int]) -> list:
    """(base + part + ".weight", info of its rows) of a file tensor stacked from parts of these sizes."""
    out, start = [], 0
    for part, size in sizes.items():
        out.append((f"{base}{part}.weight", dataclasses.replace(info, shape=(size, *info.shape[1:]),
                                                                rows=(start, start + size))))
        start += size
    return out
