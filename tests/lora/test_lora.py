"""LoRA adapters against PEFT: transformers with PeftModel gives the greedy tokens and log-probabilities
each request must get, with one adapter, with several adapters and the base model in one batch, through
chunked prefill, preemption and prefix-cache hits, and on Qwen3 and Llama."""
import pytest
import torch

from nanovllm import LLM, LoRARequest, SamplingParams
from lora_adapters import assert_like_peft, make_peft_adapter, peft_greedy
from tiny_models import make_tiny

pytest.importorskip("peft")

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
SHARED = [3 + (7 * i) % 200 for i in range(40)]
# fp32 activations and KV cache: the engine's rounding is then within 1e-4 of transformers' own.
FP32 = dict(dtype="float32", kv_cache_dtype="float32", kvcache_block_size=16)
PROMPTS = [SHARED + [11, 12, 13], [9, 8, 7, 6, 5, 4, 3], SHARED[:20] + [50 + i for i in range(30)], SHARED + [14]]


@pytest.fixture(scope="module")
def adapters(qwen3_gqa, tmp_path_factory):
    """Three adapters of the Qwen3 checkpoint: every projection at rank 8; attention only at rank 4 with
    rsLoRA; the MLP only at rank 16 with a per-module rank and alpha."""
    root = tmp_path_factory.mktemp("adapters")
    return [
        make_peft_adapter(qwen3_gqa, str(root / "all"), seed=1),
        make_peft_adapter(qwen3_gqa, str(root / "attn"), seed=2, r=4, alpha=3,
                          targets=("q_proj", "k_proj", "v_proj", "o_proj"), use_rslora=True),
        make_peft_adapter(qwen3_gqa, str(root / "mlp"), seed=3, r=16, alpha=8,
                          targets=("gate_proj", "up_proj", "down_proj"), rank_pattern={"down_proj": 6},
                          alpha_pattern={"up_proj": 20}),
    ]


@pytest.fixture(scope="module")
def references(qwen3_gqa, adapters):
    """Per adapter (None: the base model), PEFT's greedy run of every prompt."""
    return {path: peft_greedy(qwen3_gqa, path, PROMPTS, MAX_NEW) for path in [None, *adapters]}


def requests(adapters):
    return [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(adapters)]


def test_one_adapter_matches_peft(qwen3_gqa, adapters, references):
    with LLM(qwen3_gqa, enable_lora=True, max_lora_rank=16, **FP32) as llm:
        for path, request in zip(adapters, requests(adapters)):
            assert_like_peft(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=request), references[path], path)
        assert_like_peft(llm.generate(PROMPTS, GREEDY, use_tqdm=False), references[None], "base")


def test_a_rank_off_the_kernels_groups_of_four(qwen3_gqa, tmp_path):
    """A rank-6 adapter on every projection: the C kernels' groups of four rank rows leave remainders
    (B^T's 6 rows, and the stacked qkv's 18 rows of A). PEFT's tokens, decode steps in the C call."""
    adapter = make_peft_adapter(qwen3_gqa, str(tmp_path / "r6"), seed=4, r=6, alpha=5)
    with LLM(qwen3_gqa, enable_lora=True, max_lora_rank=6, **FP32) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("r6", 1, adapter))
    assert_like_peft(outs, peft_greedy(qwen3_gqa, adapter, PROMPTS, MAX_NEW), "rank 6")


def test_the_adapters_differ_from_the_base(references, adapters):
    """The test above can fail: each adapter changes the greedy tokens of some prompt."""
    base = [tokens for tokens, _ in references[None]]
    for path in adapters:
        assert [tokens for tokens, _ in references[path]] != base, path


@pytest.mark.parametrize("engine", [
    dict(),
    dict(max_num_batched_tokens=24, max_num_seqs=4),  # chunked prefill
    dict(cpu_kvcache_bytes=14 * 16384),  # preemption (2 layers x K/V x 16 x 2 heads x 32 x 4 bytes a block)
], ids=["one-batch", "chunked", "preempted"])
def test_three_adapters_and_the_base_in_one_batch(qwen3_gqa, adapters, references, engine):
    """Every prompt under each adapter and the base, all in one generate() call: rows of four adapters
    share steps. Twice: the second pass hits the prefix cache, each adapter's blocks its own."""
    reqs = [None, *requests(adapters)]
    prompts = [p for p in PROMPTS for _ in reqs]  # interleaved: neighbours run different adapters
    loras = [r for _ in PROMPTS for r in reqs]
    expected = [references[path][i] for i in range(len(PROMPTS)) for path in [None, *adapters]]
    with LLM(qwen3_gqa, enable_lora=True, max_loras=3, max_lora_rank=16, **FP32, **engine) as llm:
        steps = []
        schedule = llm.llm_engine.scheduler.schedule
        llm.llm_engine.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
        for attempt in ("first", "second"):
            assert_like_peft(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras), expected, f"{attempt} pass")
        mixed = [set(out.lora_rows) for out in steps if out.lora_rows]
        assert any(len(slots) >= 3 for slots in mixed), "no step ran several adapters together"
        assert max(len(slots - {-1}) for slots in mixed) <= 3  # at most max_loras adapters in a step
        if "cpu_kvcache_bytes" in engine:
            assert llm.llm_engine.scheduler.num_preemptions > 0
        bm = llm.llm_engine.scheduler.kv_cache_manager
        assert bm.num_free_blocks == llm.llm_engine.num_kvcache_blocks


def test_torch_products_give_peft_too(qwen3_gqa, adapters, references):
    """The updates as torch's products per slot (the path of bf16 / fp16 activations), with the C
    decode step and cpu_lora.c's lora_apply set aside: PEFT's tokens for rows of four adapters."""
    reqs = [None, *requests(adapters)]
    with LLM(qwen3_gqa, enable_lora=True, max_loras=3, max_lora_rank=16, **FP32) as llm:
        runner = llm.llm_engine.model_runner
        runner.step_runners = []
        runner.lora.use_kernels()
        outs = llm.generate([p for p in PROMPTS for _ in reqs], GREEDY, use_tqdm=False,
                            lora_request=[r for _ in PROMPTS for r in reqs])
    assert_like_peft(outs, [references[path][i] for i in range(len(PROMPTS)) for path in [None, *adapters]], "torch")


def test_a_long_prompt_takes_torch_products_beside_the_c_kernel(qwen3_gqa, adapters, monkeypatch):
    """One prefill step holding a prompt of C_GROUP_ROWS+ tokens under one adapter and short prompts
    under others: the long one's rows take torch's products, the short ones' the C kernel, in the
    same layer calls. PEFT's tokens for all."""
    from nanovllm.lora import layers
    long_prompt = [3 + (5 * i) % 250 for i in range(layers.C_GROUP_ROWS + 12)]
    prompts, reqs = [long_prompt, PROMPTS[1], PROMPTS[2]], requests(adapters)
    expected = [peft_greedy(qwen3_gqa, path, [p], MAX_NEW)[0] for path, p in zip([adapters[0], adapters[1], None], prompts)]
    seen = {"c": 0, "torch": 0}
    real_c, real_a = layers.LoRALayer.apply_c, layers.LoRALayer.slot_a
    monkeypatch.setattr(layers.LoRALayer, "apply_c", lambda self, *a: seen.__setitem__("c", seen["c"] + 1) or real_c(self, *a))
    monkeypatch.setattr(layers.LoRALayer, "slot_a", lambda self, *a: seen.__setitem__("torch", seen["torch"] + 1) or real_a(self, *a))
    with LLM(qwen3_gqa, enable_lora=True, max_loras=3, max_lora_rank=16, max_model_len=512, **FP32) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[reqs[0], reqs[1], None])
    assert_like_peft(outs, expected, "long and short prompts")
    assert seen["c"] > 0 and seen["torch"] > 0, seen


def test_the_c_decode_step_runs_adapter_rows(qwen3_gqa, adapters, references, monkeypatch):
    """The CPU's C decode step (executor/cpu_decode.py) runs steps with adapter rows: in its one call,
    rows of three adapters and the base model add their updates in C (kernels/cpu_lora.c); past its
    rows, between the layers' own matmuls, whose modules add theirs. Both give PEFT's tokens."""
    from nanovllm.executor.cpu_decode import FusedDecode
    reqs = [None, *requests(adapters)]
    with LLM(qwen3_gqa, enable_lora=True, max_loras=3, max_lora_rank=16, **FP32) as llm:
        fused = llm.llm_engine.model_runner.step_runner(FusedDecode)
        assert fused is not None
        calls = []
        real = fused.kernels.decode_layers
        monkeypatch.setattr(fused.kernels, "decode_layers", lambda *a: calls.append(a[9] is not None) or real(*a))
        for max_rows, prompts in ((fused.max_rows, PROMPTS[:1]), (2, PROMPTS[1:3])):
            fused.max_rows = max_rows
            calls.clear()
            outs = llm.generate([p for p in prompts for _ in reqs], GREEDY, use_tqdm=False,
                                lora_request=[r for _ in prompts for r in reqs])
            expected = [references[path][PROMPTS.index(p)] for p in prompts for path in [None, *adapters]]
            assert_like_peft(outs, expected, f"max_rows {max_rows}")
            # one call per decode step, with the adapters; none where every step has more rows
            assert calls == ([True] * (MAX_NEW - 1) if max_rows > 2 else []), calls


def rounded(adapter: str, dest, round_a, round_b) -> str:
    """A copy of a PEFT folder with each lora_A weight [r, in] rounded by round_a and each lora_B
    [out, r] by round_b (kept as fp32)."""
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(adapter, dest)
    weights = load_file(f"{adapter}/adapter_model.safetensors")
    save_file({k: (round_a if "lora_A" in k else round_b)(v.float()) for k, v in weights.items()},
              f"{dest}/adapter_model.safetensors")
    return str(dest)


def to_bf16(w: torch.Tensor) -> torch.Tensor:
    return w.to(torch.bfloat16).float()


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    """w's rows each as 255 steps of its largest magnitude / 127 (symmetric int8 with a row scale)."""
    step = w.abs().max(dim=1, keepdim=True).values / 127
    return torch.clamp(torch.round(w / step), -127, 127) * step


@pytest.mark.parametrize("lora_dtype, round_a, round_b", [
    ("bfloat16", to_bf16, to_bf16),
    # int8: A per rank row; B^T per rank row of each projection's outputs (B's columns)
    ("int8", int8_rows, lambda b: int8_rows(b.t()).t()),
])
def test_narrow_slots_give_peft_on_the_rounded_adapter(qwen3_gqa, adapters, tmp_path, lora_dtype, round_a, round_b):
    """lora_dtype="bfloat16" / "int8": the slots hold A and B in bf16, or in int8 with a scale per row
    (the C step widens them as it reads, the torch path per step), so the tokens and log-probabilities
    are PEFT's with the adapter's weights rounded alike (its scale, 2, folded into B, rounds alike),
    not with the weights as saved."""
    refs = peft_greedy(qwen3_gqa, rounded(adapters[0], tmp_path / lora_dtype, round_a, round_b), PROMPTS, MAX_NEW)
    with LLM(qwen3_gqa, enable_lora=True, max_lora_rank=16, lora_dtype=lora_dtype, **FP32) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=requests(adapters)[0])
    assert_like_peft(outs, refs, f"{lora_dtype} slots")
    with pytest.raises(AssertionError):  # the rounding shows: the unrounded adapter's figures differ
        assert_like_peft(outs, peft_greedy(qwen3_gqa, adapters[0], PROMPTS, MAX_NEW), "fp32 adapter")


def test_embeddings_with_an_adapter_match_peft(qwen3_gqa, adapters):
    """LLM.embed(lora_request=): the prompts' last hidden states under the adapter, as PEFT's model
    gives them (normalised last-token pooling), while another adapter's request holds a slot."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(qwen3_gqa, dtype=torch.float32),
                                      adapters[0]).eval()
    with torch.no_grad():
        ref = torch.stack([model(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0, -1]
                           for p in PROMPTS])
    ref = torch.nn.functional.normalize(ref, dim=-1)
    reqs = requests(adapters)
    with LLM(qwen3_gqa, enable_lora=True, max_loras=2, max_lora_rank=16, **FP32) as llm:
        running = llm.llm_engine.add_request(PROMPTS[1], GREEDY, lora_request=reqs[1])
        llm.llm_engine.step()  # admitted: its adapter holds a slot
        ours = torch.tensor(llm.embed(PROMPTS, pooling="last", lora_request=reqs[0]))
        base = torch.tensor(llm.embed(PROMPTS, pooling="last"))
        held = llm.llm_engine.add_request(PROMPTS[0], GREEDY, lora_request=reqs[0])
        llm.llm_engine.step()  # both slots held by running requests: a third adapter must wait
        with pytest.raises(RuntimeError, match="slots"):
            llm.embed(PROMPTS[:1], lora_request=reqs[2])
        for seq in (running, held):
            llm.llm_engine.abort_request(seq)
    assert torch.nn.functional.cosine_similarity(ours, ref, dim=-1).min() > 0.9999
    assert torch.nn.functional.cosine_similarity(base, ref, dim=-1).min() < 0.999  # the adapter shows


def test_prefix_cache_never_shares_blocks_across_adapters(qwen3_gqa, adapters):
    reqs = requests(adapters)
    with LLM(qwen3_gqa, enable_lora=True, max_loras=2, max_lora_rank=16, **FP32) as llm:
        engine = llm.llm_engine
        llm.generate([SHARED], GREEDY, use_tqdm=False, lora_request=reqs[0])
        for lora, hit in ((reqs[1], 0), (None, 0), (reqs[0], 32)):
            seq = engine.add_request(SHARED + [1], GREEDY, lora_request=lora)
            engine.scheduler.schedule()
            assert seq.num_cached_tokens == hit, lora
            engine.abort_request(seq)


def test_one_slot_serves_two_adapters_in_turn(qwen3_gqa, adapters, references):
    """max_loras=1: requests of a second adapter wait until the first one's are done, then run; the
    queue stays in order (the base model's request needs no slot)."""
    reqs = requests(adapters)
    order = [0, 1, None, 0, 1]
    with LLM(qwen3_gqa, enable_lora=True, max_loras=1, max_lora_rank=16, **FP32) as llm:
        outs = llm.generate([PROMPTS[0]] * len(order), GREEDY, use_tqdm=False,
                            lora_request=[None if i is None else reqs[i] for i in order])
    for out, i in zip(outs, order):
        ref = references[None if i is None else adapters[i]][0]
        assert_like_peft([out], [ref], f"adapter {i}")


def test_llama_adapter_matches_peft(tmp_path):
    """Llama with every bias on (the adapter adds to a biased projection) and head_dim != hidden / heads."""
    base = make_tiny(str(tmp_path / "llama"), "llama_bias", seed=4)
    adapter = make_peft_adapter(base, str(tmp_path / "adapter"), seed=5, r=8, alpha=4)
    refs = peft_greedy(base, adapter, PROMPTS[:2], MAX_NEW)
    with LLM(base, enable_lora=True, **FP32) as llm:
        outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=LoRARequest("llama", 1, adapter))
    assert_like_peft(outs, refs, "llama")


def test_tensor_parallel_adapters_match_peft(qwen3_gqa, adapters, references):
    """TP=2: each rank holds its rows of B (q/k/v, gate/up) or columns of A (o, down) and reads the
    adapters itself; the row-parallel updates are summed by the layers' all-reduce."""
    reqs = [None, *requests(adapters)]
    prompts = [p for p in PROMPTS[:2] for _ in reqs]
    loras = [r for _ in PROMPTS[:2] for r in reqs]
    expected = [references[path][i] for i in range(2) for path in [None, *adapters]]
    with LLM(qwen3_gqa, enable_lora=True, max_loras=3, max_lora_rank=16, tensor_parallel_size=2, **FP32) as llm:
        assert_like_peft(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras), expected, "TP=2")


def test_speculative_decoding_verifies_with_the_rows_adapter(qwen3_gqa, adapters):
    """n-gram proposals verified in one forward: every proposed position runs its row's adapter, so
    the greedy tokens are PEFT's."""
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 7]
    reqs = requests(adapters)
    refs = [peft_greedy(qwen3_gqa, adapters[i], [p], MAX_NEW)[0] for i, p in enumerate(prompts)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    with LLM(qwen3_gqa, enable_lora=True, max_loras=2, max_lora_rank=16, speculative_config=spec, **FP32) as llm:
        runner = llm.llm_engine.model_runner
        drafted = []
        real = runner.run
        runner.run = lambda out, drafts=None: drafted.append(drafts is not None and any(drafts)) or real(out, drafts)
        greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        outs = llm.generate(prompts, greedy, use_tqdm=False, lora_request=reqs[:2])
    assert any(drafted), "no step verified proposals"
    assert [o["token_ids"] for o in outs] == [tokens for tokens, _ in refs]
