"""Short GPU throughput check for scripts/gpu_check.sh: a random-weight model of Qwen3-0.6B's shape,
offline, run eager, with CUDA graphs, and with graphs + compiled fused ops; prints one table that
also carries the pytest results (from a JUnit XML file) when --junit is given."""
import argparse
import os
import random
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from nanovllm import LLM, SamplingParams  # noqa: E402
from tests.helpers import make_tokenizer  # noqa: E402

QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)


def make_model(path: str) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**QWEN3_0_6B, dtype="bfloat16", eos_token_id=1, bos_token_id=2, pad_token_id=0)
    config.architectures = ["Qwen3ForCausalLM"]
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(path, config.vocab_size)
    del model
    torch.cuda.empty_cache()
    return path


def run_case(path: str, name: str, args, **engine_kwargs) -> dict:
    t = time.perf_counter()
    # max_model_len bounds the graphs' block-table width, which the torch backend reads in full.
    llm = LLM(path, max_num_seqs=args.num_seqs, max_model_len=args.max_input_len + args.max_output_len,
              **engine_kwargs)
    init_s = time.perf_counter() - t
    rng = random.Random(0)
    prompts = [[rng.randrange(3, llm.llm_engine.vocab_size) for _ in range(rng.randint(16, args.max_input_len))]
               for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=0.6, max_tokens=rng.randint(16, args.max_output_len), ignore_eos=True)
              for _ in range(args.num_seqs)]
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)  # first-call lazies
    torch.cuda.synchronize()
    t = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    out_tokens = sum(len(o["token_ids"]) for o in outputs)
    row = dict(name=name, backend=llm.llm_engine.model_runner.backend.name, blocks=llm.llm_engine.num_kvcache_blocks, init_s=init_s,
               seconds=elapsed, out_tokens=out_tokens, tok_s=out_tokens / elapsed,
               in_tokens=sum(map(len, prompts)))
    llm.exit()
    del llm
    torch.cuda.empty_cache()
    return row


def junit_rows(path: str) -> list[tuple[str, str, str]]:
    """One row per test file (counts), plus one per GPU test and per failure."""
    per_file: dict[str, dict[str, int]] = {}
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        status, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                lines = (child.get("message") or "").splitlines()
                status, message = child.tag, lines[0][:70] if lines else ""
        file = case.get("classname", "").split(".")[-1]
        counts = per_file.setdefault(file, {})
        counts[status] = counts.get(status, 0) + 1
        if file == "test_gpu" or status in ("failure", "error"):
            rows.append((f"{file}::{case.get('name')}", status,
                         f"{float(case.get('time', 0)):.1f} s {message}".strip()))
    summary = [(file, ", ".join(f"{n} {s}" for s, n in sorted(c.items())), "") for file, c in per_file.items()]
    return summary + rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--max-input-len", type=int, default=512)
    parser.add_argument("--max-output-len", type=int, default=256)
    parser.add_argument("--junit", help="pytest JUnit XML file to fold into the table")
    args = parser.parse_args()

    rows = junit_rows(args.junit) if args.junit and os.path.isfile(args.junit) else []
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    # Rows are printed as they come, so a run cut short by a timeout still shows what it measured.
    print(f"\n## GPU check: {device}, torch {torch.__version__}")
    print("| check | result | detail |")
    print("|---|---|---|")
    for name, status, detail in rows:
        print(f"| test {name} | {status} | {detail} |")
    if not torch.cuda.is_available():
        return
    cases = [("eager", dict(enforce_eager=True)),
             ("graphs", dict(compile_ops=False)),
             ("graphs+compile", dict())]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(os.path.join(tmp, "qwen3-0.6b-random"))
        for name, kwargs in cases:
            try:
                r = run_case(path, name, args, **kwargs)
            except Exception as e:  # one failing case must not hide the others' numbers
                print(f"| bench {name} | error | {type(e).__name__}: {str(e)[:80]} |", flush=True)
                continue
            print(f"| bench {name} ({r['backend']}) | {r['tok_s']:.0f} out tok/s | {r['out_tokens']} out + "
                  f"{r['in_tokens']} in tokens, {args.num_seqs} seqs in {r['seconds']:.1f} s; "
                  f"init {r['init_s']:.0f} s; {r['blocks']} KV blocks |", flush=True)

if __name__ == "__main__":
    main()
