"""SamplingParams.prompt_logprobs through the whole engine on a tiny random Qwen3, against HF
transformers' log_softmax at every prompt position (fp32): a whole prompt, a chunked one, one whose
prefix is already cached, a batch mixing rows that ask and rows that don't."""
import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.helpers import make_qwen3

ENGINE = dict(device="cpu", dtype="float32", kv_cache_dtype="float32", max_model_len=256, max_num_seqs=8, kvcache_block_size=16)
P1 = list(range(5, 45))                  # 40 tokens: two full blocks and a partial one
P2 = [60, 61, 62, 63, 64, 65, 66]
P3 = list(range(200, 150, -1))           # 50 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_qwen3(str(tmp_path_factory.mktemp("qwen3_prompt_logprobs")), seed=4)


@pytest.fixture(scope="module")
def hf_logprobs(model_dir):
    """prompt -> HF's log_softmax [len(prompt), vocab] (fp32) at every prompt position."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)
    return run


def check_against_hf(entries: list, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    """entries[j] == {prompt[j]: ref[j-1, prompt[j]], then topk(ref[j-1], k)}; entries[0] is None."""
    assert len(entries) == len(prompt)
    assert entries[0] is None
    for j in range(1, len(prompt)):
        entry, row = entries[j], ref[j - 1]
        keys = list(entry)
        assert keys[0] == prompt[j], f"position {j}: the prompt token must come first"
        assert entry[prompt[j]] == pytest.approx(row[prompt[j]].item(), abs=2e-4)
        top_ids = row.topk(k).indices.tolist() if k else []
        assert set(keys) == {prompt[j]} | set(top_ids)  # torch.topk of the reference
        assert len(entry) in (k, k + 1)
        for t in keys:
            assert entry[t] == pytest.approx(row[t].item(), abs=2e-4)


def test_whole_prompt_equals_hf(model_dir, hf_logprobs, monkeypatch):
    # Slices of 7 rows: the fp32 logprobs of a step's prompt positions are made slice by slice.
    monkeypatch.setattr("nanovllm.sample.prompt_logprobs.LOGPROB_ROWS", 7)
    llm = LLM(model_dir, **ENGINE)
    try:
        sp = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=5)
        outs = llm.generate([P1, P2], sp, use_tqdm=False)
        for prompt, out in zip([P1, P2], outs):
            check_against_hf(out["prompt_logprobs"], prompt, hf_logprobs(prompt), 5)
        # k = 0: the prompt token alone; a request that does not ask gets no field.
        outs = llm.generate([P3, P2], [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0),
                                       SamplingParams(temperature=0, max_tokens=2)], use_tqdm=False)
        check_against_hf(outs[0]["prompt_logprobs"], P3, hf_logprobs(P3), 0)
        assert "prompt_logprobs" not in outs[1]
    finally:
        llm.exit()


def test_chunked_prefill_equals_hf(model_dir, hf_logprobs):
    """max_num_batched_tokens=16: P3 (50 tokens) is prefilled in 4 chunks, P1 in 3, P2 shares a
    step with the tail of another; every chunk boundary's entry needs the chunk before's last logits."""
    llm = LLM(model_dir, **dict(ENGINE, max_num_batched_tokens=16, max_num_seqs=4))
    try:
        sp = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3)
        outs = llm.generate([P3, P1, P2], sp, use_tqdm=False)
        for prompt, out in zip([P3, P1, P2], outs):
            check_against_hf(out["prompt_logprobs"], prompt, hf_logprobs(prompt), 3)
        # The completions are those of an unchunked engine's (the sampled row stays right).
        whole = LLM(model_dir, **ENGINE)
        try:
            ref = whole.generate([P3, P1, P2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        finally:
            whole.exit()
        assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in ref]
    finally:
        llm.exit()


def test_cached_prefix_is_recomputed(model_dir, hf_logprobs):
    """A request sharing P1's first two blocks with a finished one still gets every position."""
    llm = LLM(model_dir, **ENGINE)
    try:
        llm.generate([P1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        prompt = P1[:32] + [7, 8, 9]
        manager = llm.llm_engine.scheduler.kv_cache_manager
        plain = llm.llm_engine.processor.make_sequence(prompt, SamplingParams(max_tokens=2))
        assert manager._cached_prefix(plain)[0] == 2  # without prompt logprobs it would hit 2 blocks
        asking = llm.llm_engine.processor.make_sequence(prompt, SamplingParams(max_tokens=2, prompt_logprobs=2))
        assert manager._cached_prefix(asking)[0] == 0
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                           use_tqdm=False)[0]
        check_against_hf(out["prompt_logprobs"], prompt, hf_logprobs(prompt), 2)
    finally:
        llm.exit()


def test_prompt_logprobs_cap():
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20
    with pytest.raises(ValueError, match="prompt_logprobs must be in \\[0, 20\\].*got 21"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(TypeError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=1.5)


def test_tensor_parallel_equals_hf(model_dir, hf_logprobs):
    """TP=2: the LM head gathers every selected row to rank 0; workers select the same rows."""
    llm = LLM(model_dir, **dict(ENGINE, tensor_parallel_size=2, max_num_batched_tokens=16, max_num_seqs=4))
    try:
        outs = llm.generate([P3, P2], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2),
                            use_tqdm=False)
        for prompt, out in zip([P3, P2], outs):
            check_against_hf(out["prompt_logprobs"], prompt, hf_logprobs(prompt), 2)
    finally:
        llm.exit()


def test_preempted_requests_keep_one_entry_per_prompt_token(model_dir, hf_logprobs):
    """A cache of 10 blocks for four 2-block prompts growing to 3-4 blocks: some are preempted and
    recomputed; their prompt logprobs are neither recomputed twice nor lost."""
    probe = LLM(model_dir, **ENGINE)
    block_bytes = probe.llm_engine.model_runner.kv_block_bytes()
    probe.exit()
    llm = LLM(model_dir, **dict(ENGINE, max_num_batched_tokens=32, max_num_seqs=4, cpu_kvcache_bytes=10 * block_bytes))
    try:
        prompts = [list(range(40, 60)), list(range(150, 170)), list(range(200, 222)), list(range(60, 80))]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1),
                            use_tqdm=False)
        assert llm.llm_engine.scheduler.num_preemptions > 0
        for prompt, out in zip(prompts, outs):
            check_against_hf(out["prompt_logprobs"], prompt, hf_logprobs(prompt), 1)
    finally:
        llm.exit()
