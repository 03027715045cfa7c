"""A mixed workload run under tensor parallelism and the KV block size it reads, shared by the TP, MoE, sliding-window and speculative tests."""
import multiprocessing as mp
from nanovllm import LLM, SamplingParams
from nanovllm.config import Config


GREEDY = dict(temperature=0.0, ignore_eos=True)


BLOCK = 16


def workers_of(llm: LLM) -> list[mp.Process]:
    return llm.llm_engine.model_runner.pool.workers


# ---- end to end ---------------------------------------------------------------------------------
def kv_block_bytes(path: str, tp: int, kv: str = "float32") -> int:
    """One block's bytes on one rank, by hand: fp32 rows of head_dim, or int8's 34 bytes per 32."""
    cfg = Config(path).hf_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    row = head_dim * 4 if kv == "float32" else head_dim // 32 * 34
    return 2 * cfg.num_hidden_layers * BLOCK * (cfg.num_key_value_heads // tp) * row


def spy_on_schedule(llm: LLM) -> list:
    """Record (is_prefill, [(num_cached, num_computed, num_new, len)]) of every scheduled step."""
    steps, schedule = [], llm.llm_engine.scheduler.schedule

    def spy():
        out = schedule()
        steps.append((out.is_prefill, [(s.num_cached_tokens, s.num_computed_tokens, n, len(s))
                                       for s, n in zip(out.seqs, out.num_new_tokens)]))
        return out
    llm.llm_engine.scheduler.schedule = spy
    return steps


def run_mixed_workload(path: str, tp: int, kv: str = "float32", speculative_config: dict | None = None,
                       blocks: int = 10) -> tuple[list[list[int]], list, int, list[int], str]:
    """A prefix-warming request, then a batch with a prefix hit, a chunked prompt and preemption
    (tests/spec_decode runs it with speculation on), in a cache of `blocks` blocks of every layer."""
    shared = list(range(3, 3 + 2 * BLOCK))  # two full blocks
    batch = [shared + [100, 101], list(range(40, 80)), list(range(150, 162)), list(range(200, 220))]
    llm = LLM(path, tensor_parallel_size=tp, dtype="float32", kv_cache_dtype=kv, kvcache_block_size=BLOCK,
              max_num_seqs=4, max_num_batched_tokens=32, cpu_kvcache_bytes=blocks * kv_block_bytes(path, tp, kv),
              speculative_config=speculative_config)
    try:
        # The budget is per rank, and each rank holds 1/tp of a block; a block holds every layer, or
        # with KV groups (engine/kv_groups.py: sliding and full layers) the largest group's.
        runner = getattr(llm.llm_engine.model_runner, "runner", llm.llm_engine.model_runner)
        layers = Config(path).hf_config.num_hidden_layers
        assert llm.llm_engine.num_kvcache_blocks * runner.kv_cache.shape[1] == blocks * layers
        warm = llm.generate([shared + [99]], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
        steps = spy_on_schedule(llm)
        out = llm.generate(batch, SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False)
        tokens = [o["token_ids"] for o in warm + out]
        pids = [p.pid for p in workers_of(llm)] if tp > 1 else []
        shm_name = llm.llm_engine.model_runner.pool.channel.name if tp > 1 else ""
        return tokens, steps, llm.llm_engine.scheduler.num_preemptions, pids, shm_name
    finally:
        llm.exit()

