"""LLMEngine.generate's loop (shared with generate_stream): a failing step aborts the call's
requests and frees their blocks; the progress bar redraws a bounded number of times and counts tokens."""
import io
import sys
import time

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.outputs.progress import MININTERVAL_S

PROMPTS = ["the quick brown fox", "seven bright stars shine"]


@pytest.fixture(scope="module")
def llm(qwen3_gqa):
    with LLM(qwen3_gqa, kvcache_block_size=16, max_model_len=128, cpu_kvcache_bytes=16 * 16384) as engine:
        yield engine


def fail_on_call(monkeypatch, llm, n: int) -> None:
    """The model runner's n-th run from now raises."""
    real_run, calls = llm.llm_engine.model_runner.run, [0]

    def run(out):
        calls[0] += 1
        if calls[0] == n:
            raise RuntimeError("broken step")
        return real_run(out)

    monkeypatch.setattr(llm.llm_engine.model_runner, "run", run)


@pytest.mark.parametrize("streamed", [False, True])
def test_a_failing_step_aborts_the_call_and_frees_its_blocks(llm, monkeypatch, streamed):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=["zzz"], logprobs=1)
    ref = llm.generate(PROMPTS, params, use_tqdm=False)
    fail_on_call(monkeypatch, llm, 4)  # mid-decode
    with pytest.raises(RuntimeError, match="broken step"):
        if streamed:
            list(llm.generate_stream(PROMPTS, params))
        else:
            llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.llm_engine.is_finished() and not llm.llm_engine.output_processor.states
    assert llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks == llm.llm_engine.num_kvcache_blocks
    monkeypatch.undo()
    assert llm.generate(PROMPTS, params, use_tqdm=False) == ref  # nothing left behind


def test_a_failed_step_names_its_requests(llm, monkeypatch):
    first = llm.llm_engine.add_request_group([5, 6, 7], SamplingParams(max_tokens=3), request_id="a")
    llm.llm_engine.step()  # prefill "a" alone
    second = llm.llm_engine.add_request_group([8, 9], SamplingParams(max_tokens=3), request_id="b")
    fail_on_call(monkeypatch, llm, 1)
    with pytest.raises(RuntimeError) as failed:
        llm.llm_engine.step()  # the prefill of "b" (prefill goes first)
    assert failed.value.step_request_ids == {"b"}
    monkeypatch.setattr(llm.llm_engine.scheduler, "schedule", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError) as failed:
        llm.llm_engine.step()
    assert not hasattr(failed.value, "step_request_ids")  # failed before choosing: unknown
    monkeypatch.undo()
    for seq in first + second:
        llm.llm_engine.abort_request(seq)
    assert llm.llm_engine.is_finished()


def run_with_bar(llm, monkeypatch, use_tqdm: bool, max_tokens: int) -> tuple[str, float]:
    """generate() of one request with tqdm writing to a buffer (tqdm writes to sys.stderr)."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    start = time.perf_counter()
    result = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                          use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    monkeypatch.undo()
    assert len(result[0]["token_ids"]) == max_tokens
    return out.getvalue(), elapsed


def test_the_progress_bar_redraws_a_bounded_number_of_times(llm, monkeypatch):
    text, elapsed = run_with_bar(llm, monkeypatch, True, 64)
    # tqdm starts every redraw with a carriage return: one at the start, one per MININTERVAL_S
    # at most, one at the close (a redraw per step would be about 65).
    redraws = text.count("\r")
    assert 2 <= redraws <= 3 + elapsed / MININTERVAL_S
    last = text.rsplit("\r", 1)[-1]
    assert "1/1" in last and "output 64 tok" in last  # token counts, not only finished requests
    assert f"prompt {len(llm.tokenize(PROMPTS[0]))} tok" in last


def test_use_tqdm_false_writes_nothing(llm, monkeypatch):
    assert run_with_bar(llm, monkeypatch, False, 8)[0] == ""
