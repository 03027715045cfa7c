"""The Triton delta-rule decode step (kernels/triton_deltanet.py, the CUDA platform's) against the
torch step (layers/gated_deltanet.delta_rule_step) under TRITON_INTERPRET=1 on a CPU: outputs and
the states it leaves in their slots, untouched slots untouched; and a hybrid model's engine with
its linear layers' decode steps in the kernel giving the torch path's tokens."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from nanovllm.kernels.triton_deltanet import deltanet_decode_step  # noqa: E402
from nanovllm.layers.gated_deltanet import delta_rule_step, l2_normalized  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("heads,dk,dv", [(3, 16, 32), (2, 24, 48), (4, 128, 128)])
def test_step_matches_torch(heads, dk, dv):
    """dk off a power of two and dv past one 32-wide tile (masked lanes); slots out of order."""
    g = torch.Generator().manual_seed(heads * dk + dv)
    num_slots, slots = 5, torch.tensor([3, 0, 4])
    batch = len(slots)
    state = torch.randn(num_slots, heads, dk, dv, generator=g)
    q = l2_normalized(torch.randn(batch, heads, dk, generator=g)) * dk ** -0.5
    k = l2_normalized(torch.randn(batch, heads, dk, generator=g))
    v = torch.randn(batch, heads, dv, generator=g)
    decay = -torch.rand(batch, heads, generator=g)
    beta = torch.rand(batch, heads, generator=g)
    want_state = state.clone()
    rows = want_state[slots]
    want = delta_rule_step(rows, q, k, v, decay, beta)
    want_state[slots] = rows
    got_state = state.to(DEVICE)
    got = deltanet_decode_step(got_state, slots.to(DEVICE), *(x.to(DEVICE) for x in (q, k, v, decay, beta)))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state.cpu(), want_state, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_state.cpu()[[1, 2]], state[[1, 2]])  # other sequences' slots as they were


def test_a_state_of_another_shape_is_refused():
    with pytest.raises(ValueError, match=r"fp32 \[slots, 2, 8, 8\] expected"):
        deltanet_decode_step(torch.zeros(1, 2, 8, 4), torch.zeros(1, dtype=torch.int64), torch.zeros(1, 2, 8),
                             torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2), torch.zeros(1, 2))


def test_engine_decodes_through_the_kernel(tmp_path):
    """A tiny Qwen3.5's decode steps with every linear layer on the Triton step (the C step set
    aside): the torch path's greedy tokens."""
    from nanovllm import LLM, SamplingParams
    from hybrid_checkpoints import make_checkpoint, prompts
    path = make_checkpoint("qwen3_5", str(tmp_path / "qwen3_5"))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    batch = prompts()[:3]
    with LLM(path, dtype="float32", kvcache_block_size=16, cpu_kvcache_bytes=8 << 20) as llm:
        llm.llm_engine.model_runner.step_runners = []
        layers = llm.llm_engine.model_runner.state_layers
        for layer in layers:
            layer.attach_state(layer.state)  # no C kernels: the torch step
        want = [o["token_ids"] for o in llm.generate(batch, sp, use_tqdm=False)]
        calls = []
        import nanovllm.kernels.triton_deltanet as module
        real = module.deltanet_decode_step

        def counted(*args):
            calls.append(1)
            return real(*args)
        module.deltanet_decode_step = counted
        try:
            for layer in layers:
                layer.attach_state(layer.state, use_triton=True)
            got = [o["token_ids"] for o in llm.generate(batch, sp, use_tqdm=False)]
        finally:
            module.deltanet_decode_step = real
    assert calls and got == want


@pytest.mark.parametrize("heads,p,n", [(3, 16, 16), (2, 48, 24), (4, 64, 128)])
def test_mamba2_step_matches_torch(heads, p, n):
    """Mamba-2's one-token rule in Triton against layers/mamba2.ssd_step plus D x: P past one
    32-row tile and N off a power of two (masked lanes); slots out of order, others untouched."""
    from nanovllm.kernels.triton_deltanet import mamba2_decode_step
    from nanovllm.layers.mamba2 import ssd_step
    g = torch.Generator().manual_seed(heads * p + n)
    slots = torch.tensor([3, 0, 4])
    batch = len(slots)
    state = torch.randn(5, heads, p, n, generator=g)
    x = torch.randn(batch, heads, p, generator=g)
    B, C = torch.randn(batch, heads, n, generator=g), torch.randn(batch, heads, n, generator=g)
    dt, A = torch.rand(batch, heads, generator=g), -torch.rand(heads, generator=g) * 2
    D = torch.randn(heads, generator=g)
    want_state = state.clone()
    rows = want_state[slots]
    want = ssd_step(rows, x, dt, A, B, C) + D[:, None] * x
    want_state[slots] = rows
    got_state = state.to(DEVICE)
    got = mamba2_decode_step(got_state, slots.to(DEVICE), *(t.to(DEVICE) for t in (x, dt, A, B, C, D)))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state.cpu(), want_state, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_state.cpu()[[1, 2]], state[[1, 2]])


def test_granite_engine_decodes_through_the_mamba2_kernel(tmp_path):
    """A tiny Granite 4.0-H's decode steps with its Mamba-2 layers' state update on the Triton step
    (the C kernel set aside): the torch path's greedy tokens."""
    from state_models import GRANITE_PROMPTS as PROMPTS, make_granite as make
    from nanovllm import LLM, SamplingParams
    import nanovllm.kernels.triton_deltanet as module
    path = make(str(tmp_path / "granite"))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(path, dtype="float32", kvcache_block_size=16, cpu_kvcache_bytes=8 << 20) as llm:
        llm.llm_engine.model_runner.step_runners = []  # (the C one call)
        layers = llm.llm_engine.model_runner.state_layers
        for layer in layers:
            layer.attach_state(layer.state)  # no C kernels: the torch step
        want = [o["token_ids"] for o in llm.generate(PROMPTS[:3], sp, use_tqdm=False)]
        calls, real = [], module.mamba2_decode_step
        module.mamba2_decode_step = lambda *args: calls.append(1) or real(*args)
        try:
            for layer in layers:
                layer.attach_state(layer.state, use_triton=True)
            got = [o["token_ids"] for o in llm.generate(PROMPTS[:3], sp, use_tqdm=False)]
        finally:
            module.mamba2_decode_step = real
    assert calls and got == want
