"""Adapters on mixture-of-experts models against PEFT: attention, the dense MLP layers, Qwen2-MoE's
shared expert and the experts themselves (PEFT's target_parameters on the stacked gate_up_proj /
down_proj), mixed with the base model in one batch; other target_parameters are refused by name."""
import json

import pytest

from lora_adapters import assert_like_peft, make_peft_adapter, peft_greedy
from moe_checkpoints import make_moe
from nanovllm import LLM, LoRARequest, SamplingParams
from nanovllm.lora.adapter import LoRAError

pytest.importorskip("peft")

PROMPTS = [[3, 5, 7, 9, 11, 13, 15, 17], [20, 30, 40, 50, 60]]
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
FP32 = dict(dtype="float32", kv_cache_dtype="float32", kvcache_block_size=16)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
TARGETS = {"qwen3_moe_norm": ATTENTION + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),  # layer 1 is dense
           "qwen2_moe_shared": ATTENTION + ("shared_expert.gate_proj", "shared_expert.up_proj",
                                            "shared_expert.down_proj")}


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_moe_model_adapters_match_peft(name, tmp_path):
    base = make_moe(str(tmp_path / name), name, seed=1)
    adapter = make_peft_adapter(base, str(tmp_path / "lora"), seed=2, r=4, alpha=8, targets=TARGETS[name])
    refs, plain = peft_greedy(base, adapter, PROMPTS, MAX_NEW), peft_greedy(base, None, PROMPTS, MAX_NEW)
    assert [t for t, _ in refs] != [t for t, _ in plain]  # the adapter changes the answers
    with LLM(base, enable_lora=True, **FP32) as llm:
        outs = llm.generate(PROMPTS * 2, GREEDY, use_tqdm=False,
                            lora_request=[LoRARequest("moe", 1, adapter)] * 2 + [None] * 2)
    assert_like_peft(outs, refs + plain, name)


@pytest.mark.parametrize("tp", [1, 2])
def test_adapters_on_the_experts_match_peft(tp, tmp_path):
    """PEFT adds its target_parameters (the stacked experts' gate_up_proj and down_proj, each expert
    its own rank-r update) for gate_proj / up_proj / down_proj on a transformers MoE block: every
    expert's update applies to the rows routed to it, beside the attention's and the dense layer's;
    rows of the base model in the same steps keep the C experts. TP=2: each rank takes its gate / up
    rows of B and its down columns of A, summed by the layer's all-reduce."""
    base = make_moe(str(tmp_path / "moe"), "qwen3_moe_norm", seed=1)
    adapter = make_peft_adapter(base, str(tmp_path / "experts"), seed=2, r=4, alpha=8)
    with open(f"{adapter}/adapter_config.json") as f:
        assert json.load(f)["target_parameters"]  # the experts are targeted
    refs, plain = peft_greedy(base, adapter, PROMPTS, MAX_NEW), peft_greedy(base, None, PROMPTS, MAX_NEW)
    without = make_peft_adapter(base, str(tmp_path / "no-experts"), seed=2, r=4, alpha=8,
                                targets=TARGETS["qwen3_moe_norm"])
    assert [t for t, _ in refs] != [t for t, _ in peft_greedy(base, without, PROMPTS, MAX_NEW)]  # the experts' share
    with LLM(base, enable_lora=True, max_lora_rank=8, tensor_parallel_size=tp, **FP32) as llm:
        outs = llm.generate(PROMPTS * 2, GREEDY, use_tqdm=False,
                            lora_request=[LoRARequest("experts", 1, adapter)] * 2 + [None] * 2)
    assert_like_peft(outs, refs + plain, f"experts, TP={tp}")


def test_an_adapter_on_other_parameters_is_refused_by_name(tmp_path):
    base = make_moe(str(tmp_path / "moe"), "qwen3_moe_norm", seed=1)
    adapter = make_peft_adapter(base, str(tmp_path / "experts"), seed=2, r=4)
    with open(f"{adapter}/adapter_config.json") as f:
        config = json.load(f)
    config["target_parameters"] = ["gate.weight"]
    with open(f"{adapter}/adapter_config.json", "w") as f:
        json.dump(config, f)
    with LLM(base, enable_lora=True, **FP32) as llm:
        with pytest.raises(LoRAError, match="target_parameters .*gate.weight"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("odd", 1, adapter))
