"""The seat of a weight format (layers/quantization): a toy format registered through the registry
alone (fp32 weights stored transposed, [input, output]) loads from a checkpoint whose config.json
names it, shards and stacks by its parameters' tags, and gives the tokens of the dense engine on
the untransposed weights; ignored modules stay dense; an unknown quant_method is a clear error;
the C decode step runs every layer it can describe and the others through their own modules."""
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from helpers import make_qwen3
from nanovllm import LLM, SamplingParams
from nanovllm import models
from nanovllm.executor import cpu_decode
from nanovllm.kernels import cpu_kernels
from nanovllm.layers import quantization
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.quantization import (LinearMethodBase, QuantizationConfig, UnquantizedLinearMethod,
                                          register_quantization_config)
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.executor.cpu_decode import FusedDecode

HAS_CC = shutil.which("cc") is not None or shutil.which("gcc") is not None


class TransposedMethod(LinearMethodBase):
    """W held as W^T [input, output]: its output dim is 1, so every loader must follow the tags."""

    name = "toy-transposed"

    def create_weights(self, layer, input_size, output_partition_sizes, params_dtype):
        layer.register_weight("weight_t", torch.empty(input_size, sum(output_partition_sizes), dtype=params_dtype),
                              output_dim=1, input_dim=0)

    def apply(self, layer, x, bias):
        y = x @ layer.weight_t
        return y if bias is None else y + bias


class TransposedConfig(QuantizationConfig):
    name = "toy_transposed"

    def __init__(self, ignore: list[str]):
        self.ignore = ignore

    @classmethod
    def from_model(cls, path, hf_config, packed_modules_mapping):
        qc = getattr(hf_config, "quantization_config", None) or {}
        return cls(qc.get("ignore", [])) if qc.get("quant_method") == cls.name else None

    def linear_method(self, layer, prefix):
        return TransposedMethod() if prefix not in self.ignore else None
        # (lm_head, the embedding and ignored layers stay dense: the base config's answer)


@pytest.fixture
def toy_format(monkeypatch):
    """TransposedConfig registered for this test only."""
    monkeypatch.setattr(quantization, "_REGISTRY", dict(quantization._REGISTRY))
    register_quantization_config(TransposedConfig)
    assert "toy_transposed" in quantization.quantization_methods()


STACKED_IN = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
              "up_proj": "gate_up_proj"}


def write_transposed(src: str, dst: str, ignore: list[str] = ()) -> str:
    """src's checkpoint with every projection (but the ignored) stored as `weight_t` = W^T, and a
    quantization_config naming the format."""
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        # our module's prefix: q/k/v_proj are stacked in qkv_proj, gate/up_proj in gate_up_proj
        parent, _, leaf = module.rpartition(".")
        ours = f"{parent}.{STACKED_IN.get(leaf, leaf)}"
        if name.endswith("_proj.weight") and ours not in ignore:
            out[module + ".weight_t"] = t.T.contiguous()
        else:
            out[name] = t
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "toy_transposed", "ignore": list(ignore)}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def greedy(path: str, prompts, **kwargs):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    with LLM(path, dtype="float32", kvcache_block_size=16, max_model_len=128, cpu_kvcache_bytes=1 << 24,
             **kwargs) as llm:
        return llm.generate(prompts, sp, use_tqdm=False), describe(llm)


def describe(llm) -> dict:
    model = llm.llm_engine.model_runner.model
    layer0 = model.model.layers[0]
    fused = llm.llm_engine.model_runner.step_runner(FusedDecode)
    return {"qkv_params": sorted(n for n, _ in layer0.self_attn.qkv_proj.named_parameters()),
            "head": type(model.lm_head.quant_method), "fused_segments": None if fused is None else fused.segments}


def assert_same(outs, ref):
    for a, b in zip(outs, ref):
        assert a["token_ids"] == b["token_ids"]
        for la, lb in zip(a["logprobs"], b["logprobs"]):
            assert la.keys() == lb.keys()
            assert all(la[t] == pytest.approx(lb[t], abs=1e-4) for t in la)


PROMPTS = [[3, 9, 27, 81] * 3, [5, 7] * 9, [11] * 20]


@pytest.mark.parametrize("fixture", ["qwen3_gqa", "qwen3_bias_tied"])
def test_toy_format_through_the_registry_gives_the_dense_tokens(fixture, request, toy_format, tmp_path):
    src = request.getfixturevalue(fixture)
    ignored = "model.layers.1.mlp.down_proj"
    path = write_transposed(src, str(tmp_path / "toy"), ignore=[ignored])
    ref, _ = greedy(src, PROMPTS)
    outs, seen = greedy(path, PROMPTS)
    assert_same(outs, ref)
    # The layers hold only their method's parameters; lm_head (not a LinearBase) and the ignored
    # layer stay dense.
    assert seen["qkv_params"] == (["bias", "weight_t"] if fixture == "qwen3_bias_tied" else ["weight_t"])
    assert seen["head"] is UnquantizedLinearMethod
    with LLM(path, dtype="float32", max_model_len=64, cpu_kvcache_bytes=1 << 22) as llm:
        layers = llm.llm_engine.model_runner.model.model.layers
        assert type(layers[1].mlp.down_proj.quant_method) is UnquantizedLinearMethod
        assert type(layers[0].mlp.down_proj.quant_method) is TransposedMethod
        if HAS_CC:  # no layer has C views: each runs its own modules, the head still in C
            fused = llm.llm_engine.model_runner.step_runner(FusedDecode)
            assert fused.one_call_layers == 0 and fused.head_in_c


def test_unknown_quant_method_is_a_clear_error(qwen3_gqa, tmp_path):
    path = str(tmp_path / "gptq")
    shutil.copytree(qwen3_gqa, path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "no_such_format", "bits": 4}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"quantization method 'no_such_format' .* is not supported; "
                                         r"supported: \[.*'compressed-tensors'.*'gptq'"):
        LLM(path, max_model_len=64, cpu_kvcache_bytes=1 << 22)


def test_a_registered_name_is_not_taken_twice(toy_format):
    class Other(TransposedConfig):
        pass
    with pytest.raises(ValueError, match="already registered"):
        register_quantization_config(Other)


# ---- loaders driven by the parameters' tags (the tensor-parallel split simulated) -----------------
def test_stacked_and_sharded_loads_follow_the_tags(toy_format, monkeypatch):
    from nanovllm.layers import linear
    config = TransposedConfig([])
    q, k, v = torch.randn(8, 6), torch.randn(4, 6), torch.randn(4, 6)   # 2 heads of 4, 1 KV head
    down = torch.randn(6, 8)
    for rank in (0, 1):
        monkeypatch.setattr(linear, "get_tp_rank", lambda: rank)
        monkeypatch.setattr(linear, "get_tp_size", lambda: 2)
        qkv = QKVParallelLinear(6, 4, 2, 2, quant_config=config, prefix="qkv")
        for shard_id, t in zip("qkv", (q, torch.cat([k, k + 1]), torch.cat([v, v + 1]))):
            qkv.weight_t.weight_loader(qkv.weight_t, t.T.contiguous(), shard_id)
        part = slice(4 * rank, 4 * rank + 4)
        expected = torch.cat([q[part], torch.cat([k, k + 1])[part], torch.cat([v, v + 1])[part]])
        assert torch.equal(qkv.weight_t, expected.T)
        row = RowParallelLinear(8, 6, bias=True, quant_config=config, prefix="down")
        row.weight_t.weight_loader(row.weight_t, down.T.contiguous())
        row.bias.weight_loader(row.bias, torch.arange(6.0))
        assert torch.equal(row.weight_t, down.T[part])  # the input dim (0 here) is split
        assert torch.equal(row.bias, torch.arange(6.0))  # a row-parallel bias is whole on each rank


class PackedRowsMethod(LinearMethodBase):
    """Weights packed 4 output rows per entry (a stand-in for int4-in-int32 layouts)."""

    name = "toy-packed"

    def create_weights(self, layer, input_size, output_partition_sizes, params_dtype):
        layer.register_weight("packed", torch.empty(sum(output_partition_sizes) // 4, 4 * input_size),
                              output_dim=0, input_dim=1, packed_dim=0, packed_factor=4)

    def apply(self, layer, x, bias):
        return x @ layer.packed.view(-1, x.shape[1]).T


def test_packed_dim_offsets_are_in_packed_units():
    class Packed(QuantizationConfig):
        name = "toy_packed"

        def linear_method(self, layer, prefix):
            return PackedRowsMethod()
    merged = MergedColumnParallelLinear(3, [8, 4], quant_config=Packed(), prefix="gate_up")
    gate, up = torch.randn(8, 3), torch.randn(4, 3)
    merged.packed.weight_loader(merged.packed, up.reshape(1, 12), 1)
    merged.packed.weight_loader(merged.packed, gate.reshape(2, 12), 0)
    x = torch.randn(2, 3)
    torch.testing.assert_close(merged(x), x @ torch.cat([gate, up]).T)
    odd = MergedColumnParallelLinear(3, [6, 6], quant_config=Packed(), prefix="odd")
    with pytest.raises(ValueError, match="do not fill whole packed entries"):
        odd.packed.weight_loader(odd.packed, torch.empty(1, 12), 1)


# ---- the C decode per layer, by capability ---------------------------------------------------------
class PlainMLP(nn.Module):
    """The gated MLP's math in a block the C step does not know (as a MoE block would be)."""

    def __init__(self, config, quant_config, prefix):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class OneOddLayer(Qwen3ForCausalLM):
    def make_mlp(self, config, layer_idx, prefix, quant_config):
        if layer_idx == 2:
            return PlainMLP(config, quant_config, prefix)
        return super().make_mlp(config, layer_idx, prefix, quant_config)


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    return make_qwen3(str(tmp_path_factory.mktemp("four")), shape="bias_tied", seed=5, num_hidden_layers=4)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
@pytest.mark.parametrize("odd", ["mlp_block", "weight_format"])
def test_a_layer_the_c_step_cannot_describe_leaves_the_others_fused(odd, four_layers, toy_format, tmp_path,
                                                                    monkeypatch):
    """Layer 2 is another MLP block (make_mlp) or in a format without C views: the decode step still
    runs layers 0-1 and 3 (and the embedding and head) in C, layer 2 through its modules; tokens and
    logprobs equal the eager forward's and the plain model's."""
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

    def batches(llm):  # batch 1 and 2: the one-call path; 3: C phases between the matmuls
        return [llm.generate([p], sp, use_tqdm=False)[0] for p in PROMPTS] + \
            llm.generate(PROMPTS[:2], sp, use_tqdm=False) + llm.generate(PROMPTS, sp, use_tqdm=False)
    options = dict(dtype="float32", kvcache_block_size=16, max_model_len=128, cpu_kvcache_bytes=1 << 24)
    with LLM(four_layers, **options) as llm:
        ref = batches(llm)
    path = four_layers
    if odd == "mlp_block":
        monkeypatch.setattr(models, "get_model_class", lambda hf_config: OneOddLayer)
    else:
        keep = [f"model.layers.{i}.{m}" for i in (0, 1, 3)
                for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
        path = write_transposed(four_layers, str(tmp_path / "toy"), ignore=keep)
    with LLM(path, **options) as llm:
        fused = llm.llm_engine.model_runner.step_runner(FusedDecode)
        assert isinstance(fused, cpu_decode.FusedDecode)
        assert fused.segments == [(0, 2, True), (2, 3, False), (3, 4, True)]
        assert fused.embed_in_c and fused.head_in_c
        calls = []
        real = fused.kernels.decode_layers
        monkeypatch.setattr(fused.kernels, "decode_layers", lambda *a: calls.append((a[3], a[4])) or real(*a))
        outs = batches(llm)
        assert set(calls) == {(0, 2), (3, 4)}
        llm.llm_engine.model_runner.step_runners = []
        eager = batches(llm)
    assert_same(outs, ref)
    assert_same(eager, ref)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_the_library_abi_is_checked_at_load():
    import ctypes
    kernels = cpu_kernels.load()
    cpu_kernels.check_abi(kernels.lib)  # this module's structures match

    class Linear(ctypes.Structure):  # one field short of the C layout
        _fields_ = [("data", ctypes.c_void_p), ("n", ctypes.c_int64)]

    class Unknown(ctypes.Structure):
        _fields_ = [("x", ctypes.c_int64)]
    with pytest.raises(RuntimeError, match="struct Linear is 72 bytes in C, 16 in ctypes"):
        cpu_kernels.check_abi(kernels.lib, (Linear,))
    with pytest.raises(RuntimeError, match="struct Unknown is -1 bytes in C"):
        cpu_kernels.check_abi(kernels.lib, (Unknown,))
