"""Layers describe themselves to the C decode step (layers/c_description.py), and the executor's
walker (executor/cpu_decode.py) knows no model class: a part it cannot run is named, with the
reason, in a WARNING of the start-up summary; a subclass computing something else is not described
by its parent's describer; a new layer class that registers a describer runs in C, and its tokens
equal the eager forward's."""
import ctypes
import logging
import shutil

import pytest
import torch

from helpers import make_qwen3
from nanovllm import LLM, SamplingParams
from nanovllm import models
from nanovllm.executor.cpu_decode import FusedDecode
from nanovllm.kernels.cpu_structs import DecoderLayer
from nanovllm.layers.c_description import by_field, describes
from nanovllm.models.decoder import DecoderLayer as DecoderBlock
from nanovllm.models.decoder import _c_decoder_layer
from nanovllm.models.qwen3 import Qwen3ForCausalLM

HAS_CC = shutil.which("cc") is not None or shutil.which("gcc") is not None
PROMPTS = [[5, 9, 13, 2, 77, 31], [101, 7, 64], [3, 3, 8, 250, 19, 44, 12]]
OPTIONS = dict(dtype="float32", kvcache_block_size=16, max_model_len=128, cpu_kvcache_bytes=1 << 24)


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    return make_qwen3(str(tmp_path_factory.mktemp("four")), seed=7, num_hidden_layers=4)


def test_a_structure_is_built_by_field_name_and_an_unknown_name_is_refused():
    layer = by_field(DecoderLayer, {"window": 7, "kv_group": 1})
    assert (layer.window, layer.kv_group, layer.in_c) == (7, 1, 0)
    with pytest.raises(ValueError, match=r"DecoderLayer has no field \['windw'\]"):
        by_field(DecoderLayer, {"windw": 7})


class ScaledLayer(DecoderBlock):
    """A layer that halves its MLP's output: computes something else than its parent."""

    def forward(self, positions, hidden_states, residual):
        out, residual = super().forward(positions, hidden_states, residual)
        return out * 0.5, residual


def capped_layer(config, layer_idx, *args):
    """The shared layer; layer 1's attention scores soft-capped (the C step's softmax has none)."""
    layer = DecoderBlock(config, layer_idx, *args)
    if layer_idx == 1:
        layer.self_attn.attn.logit_softcap = 30.0
    return layer


def model_with(layer_class):
    class Model(Qwen3ForCausalLM):
        def __init__(self, config, quant_config=None):
            super().__init__(config, quant_config)
            prefix = "model.layers"
            rope = self.model.layers[0].self_attn.rotary_emb
            self.model.layers = torch.nn.ModuleList(
                layer_class(config, i, False, False, True, rope, quant_config, f"{prefix}.{i}", self.make_mlp)
                for i in range(config.num_hidden_layers))
    return Model


def greedy(llm):
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [o["token_ids"] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
@pytest.mark.parametrize("layer_class, reason", [
    (ScaledLayer, "layer 0 (ScaledLayer) has no C description"),
    (capped_layer, "layer 1: its attention: its paged attention: its scores are soft-capped"),
])
def test_a_part_the_c_step_cannot_run_is_a_startup_warning_naming_it(layer_class, reason, four_layers, monkeypatch,
                                                                      caplog):
    monkeypatch.setattr(models, "get_model_class", lambda hf_config: model_with(layer_class))
    with caplog.at_level(logging.WARNING, logger="nanovllm"), LLM(four_layers, **OPTIONS) as llm:
        assert llm.llm_engine.model_runner.step_runner(FusedDecode) is None
        eager = greedy(llm)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("decode steps run the eager forward, not the C step" in w and reason in w for w in warnings), warnings
    if layer_class is ScaledLayer:  # the eager forward runs what the layer computes
        monkeypatch.setattr(models, "get_model_class", lambda hf_config: Qwen3ForCausalLM)
        with LLM(four_layers, **OPTIONS) as llm:
            assert greedy(llm) != eager


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_a_new_layer_class_that_describes_itself_runs_in_c(four_layers, monkeypatch):
    """ScaledBack computes what its parent does; registered with its parent's describer, it runs in
    the one call with no change to the executor, and its tokens equal the eager forward's."""
    class ScaledBack(DecoderBlock):
        def forward(self, positions, hidden_states, residual):
            return super().forward(positions, hidden_states, residual)
    monkeypatch.setattr(models, "get_model_class", lambda hf_config: model_with(ScaledBack))
    with LLM(four_layers, **OPTIONS) as llm:
        assert llm.llm_engine.model_runner.step_runner(FusedDecode) is None
    describes(ScaledBack)(_c_decoder_layer)
    with LLM(four_layers, **OPTIONS) as llm:
        fused = llm.llm_engine.model_runner.step_runner(FusedDecode)
        assert fused is not None and fused.one_call_layers == 4
        assert all(ctypes.addressof(layer) for layer in fused.layers) and fused.layers[3].in_c == 1
        in_c = greedy(llm)
        llm.llm_engine.model_runner.step_runners = []
        assert greedy(llm) == in_c
