"""The soak (scripts/soak.py), short: 150 random requests (sizes, n, sampling options, streams,
40% of the streams dropped by the client at a random chunk) against an in-process server on a
tiny model. Nothing is lost: every answer a 200, no error event, the engine back to 0 running /
0 waiting / every KV block free, the fixed greedy request's text the same before and after and
equal to an offline engine's, RSS within 15%; and the prefix cache is consistent (a hand check of
the block manager: every block free with no reference, every hash naming a block that holds it)."""
import os
import sys

from server_fixtures import ENGINE_OPTIONS, MODEL, probe, serve_engine  # noqa: F401

from nanovllm import LLM, SamplingParams
from nanovllm.entrypoints.openai_server import build_app

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts"))
import soak  # noqa: E402


def block_manager_problems(llm) -> list[str]:
    bm = llm.llm_engine.scheduler.kv_cache_manager
    problems = []
    if bm.num_free_blocks != bm.num_blocks:
        problems.append(f"{bm.num_blocks - bm.num_free_blocks} blocks not free")
    problems += [f"block {b.block_id} ref_count {b.ref_count}" for b in bm.pool.blocks if b.ref_count != 0]
    for (group, h), block_id in bm.pool.hash_to_block_id.items():
        if (bm.pool.blocks[block_id].group, bm.pool.blocks[block_id].hash) != (group, h):
            problems.append(f"hash {h} of group {group} names block {block_id}, which holds {bm.pool.blocks[block_id].hash}")
    if bm.seq_block_hashes:
        problems.append(f"{len(bm.seq_block_hashes)} sequences still listed")
    return problems


def test_short_soak_loses_nothing(qwen3_gqa):
    with LLM(qwen3_gqa, **ENGINE_OPTIONS) as offline:
        want = offline.generate([soak.FIXED["prompt"]], SamplingParams(temperature=0, max_tokens=soak.FIXED["max_tokens"]),
                                use_tqdm=False)[0]["text"]
    llm = LLM(qwen3_gqa, **ENGINE_OPTIONS)
    with serve_engine(llm, [lambda engine: build_app(engine, MODEL)]) as (engine, (url,)):
        report = soak.run(url, MODEL, requests=150, concurrency=8, seed=0, pid=os.getpid())
        assert probe(engine, block_manager_problems) == []
        assert soak.fixed_text(url, MODEL) == want
    print(report)
    assert report["lost"] == [], report
    tally = report["tally"]
    assert tally["status 200"] == 150 and tally["dropped by the client"] >= 10, tally
