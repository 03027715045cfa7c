"""torch.compile of the fused ops (opt-in on CPU, Config.compile_ops): compiled == eager.

Compiling costs tens of seconds on a cold CPU, so this file holds a single test.
"""
import pytest
import torch

from nanovllm import LLM
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.context import forward_context
from tests.helpers import make_qwen3


@pytest.mark.slow
def test_compiled_fused_ops_equal_eager(tmp_path):
    path = make_qwen3(str(tmp_path / "m"))  # 2 layers, qk-norm
    # 27 prefill tokens: no size coincides with a model dim (dynamo would specialize on it).
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 40))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eager = LLM(path, device="cpu", dtype="float32", kv_cache_dtype="float32", cpu_kvcache_bytes=1 << 22)
    assert eager.config.compile_ops is False  # off by default on CPU
    compiled = LLM(path, device="cpu", dtype="float32", kv_cache_dtype="float32", cpu_kvcache_bytes=1 << 22, compile_ops=True)

    # Hand count: per layer input/post-attention norms, q/k norms, SiLU-and-mul; the final norm;
    # one RoPE shared by all layers.
    wrapped = [m for m in compiled.llm_engine.model_runner.model.modules() if getattr(m, "_compiled_call_impl", None)]
    assert len(wrapped) == 2 * 5 + 1 + 1
    assert {type(m) for m in wrapped} == {RMSNorm, SiluAndMul, RotaryEmbedding}

    # Same hidden states for one prefill batch (the model run directly, no cache involved).
    runner_e, runner_c = eager.llm_engine.model_runner, compiled.llm_engine.model_runner
    seqs = [Sequence(p) for p in prompts]
    input_ids, positions, context, _ = runner_e.prepare_prefill(seqs, [len(p) for p in prompts])
    context.slot_mapping = None
    with torch.inference_mode():
        with forward_context(context):
            h_eager = runner_e.model(input_ids, positions)
        with forward_context(context):
            h_comp = runner_c.model(input_ids, positions)
    torch.testing.assert_close(h_comp, h_eager, rtol=1e-5, atol=1e-5)

    # And the same greedy tokens end to end (prefill and decode shapes).
    out_e = eager.generate(prompts, params, use_tqdm=False)
    out_c = compiled.generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in out_c] == [o["token_ids"] for o in out_e]
    eager.exit()
    compiled.exit()

    # bf16 (where compiling pays on CPU): within one bf16 rounding of eager.
    norm = RMSNorm(64).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    x, r = torch.randn(9, 64).to(torch.bfloat16), torch.randn(9, 64).to(torch.bfloat16)
    y_eager, res_eager = norm(x, r)
    norm.compile(dynamic=True)
    y_comp, res_comp = norm(x, r)
    assert torch.equal(res_comp, res_eager)
    torch.testing.assert_close(y_comp, y_eager, rtol=2 ** -7, atol=0)
