"""Adapters on mixture-of-experts models against PEFT: attention, the dense MLP layers and Qwen2-MoE's
shared expert, mixed with the base model in one batch; an adapter on the experts themselves (PEFT's
target_parameters, which it adds for gate_proj / up_proj / down_proj on these models) is refused by
name."""
import pytest
import torch

from lora_adapters import make_peft_adapter, peft_greedy
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
    for out, (tokens, logprobs) in zip(outs, refs + plain):
        assert out["token_ids"] == tokens
        ours = torch.tensor([next(iter(step.values())) for step in out["logprobs"]])
        theirs = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
        assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()


def test_an_adapter_on_the_experts_is_refused_by_name(tmp_path):
    base = make_moe(str(tmp_path / "moe"), "qwen3_moe_norm", seed=1)
    adapter = make_peft_adapter(base, str(tmp_path / "experts"), seed=2, r=4)  # PEFT adds the experts
    with LLM(base, enable_lora=True, **FP32) as llm:
        with pytest.raises(LoRAError, match="target_parameters .*experts"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("experts", 1, adapter))
