"""Decode speed with LoRA adapters: N sequences each running its own adapter (rank R on every projection)
against the same N sequences on the base model alone, in one engine, one job at a time; and the peak
RSS with the N adapters resident.

    python scripts/bench_lora.py                      # the default model, 8 adapters of rank 16
    python scripts/bench_lora.py --model DIR --adapters 8 --rank 16 --tokens 64
    python scripts/bench_lora.py --llamacpp          # and llama.cpp with one adapter (its GGUF file)

The adapters are random (the engine's own LoRA targets give their shapes), written as PEFT folders
(adapter_config.json + adapter_model.safetensors): the speed does not depend on what they learned."""
import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def write_adapter(path: Path, targets: dict, rank: int, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, target in targets.items():
        prefix = f"base_model.model.{name}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, target.input_size, generator=generator) * 0.01
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(target.output_size, rank, generator=generator) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    modules = sorted({name.rsplit(".", 1)[-1] for name in targets})
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules}))


def timed(llm, prompts, sp, loras) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    return sum(len(o["token_ids"]) for o in outs) / seconds


def main() -> None:
    os.environ.pop("OMP_WAIT_POLICY", None)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or GGUF file (default: the default model)")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64, help="tokens each sequence decodes")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--runs", type=int, default=3, help="best of")
    p.add_argument("--lora-dtype", default="auto", help="the slots' precision (EngineArgs.lora_dtype)")
    p.add_argument("--llamacpp", action="store_true",
                   help="also llama.cpp (llama-batched-bench, built once) on the same GGUF model without and with "
                        "adapter 0 (--lora; llama.cpp applies one adapter set to the whole batch), converted by its "
                        "convert_lora_to_gguf.py; our engine runs that file too")
    p.add_argument("--hf-base", default=None, help="the GGUF model's HF folder, for the adapter converter's config "
                                                   "(default: the default model's converted folder)")
    args = p.parse_args()
    from nanovllm import LLM, LoRARequest, SamplingParams
    from nanovllm.utils.default_model import default_model

    model = args.model or default_model()
    n = args.adapters
    llm = LLM(model, enable_lora=True, max_loras=n, max_lora_rank=args.rank, max_num_seqs=max(n, 8),
              lora_dtype=args.lora_dtype)
    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    targets = llm.llm_engine.model_runner.lora.targets
    loras = []
    for i in range(n):
        write_adapter(work / f"a{i}", targets, args.rank, seed=i)
        loras.append(LoRARequest(f"a{i}", i + 1, str(work / f"a{i}")))
    prompts = [[100 + 7 * i + j for j in range(args.prompt)] for i in range(n)]
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    timed(llm, prompts, sp, loras)  # warm-up: the adapters read and placed in their slots
    timed(llm, prompts, sp, None)
    runner = llm.llm_engine.model_runner
    runs = {"base model": None, "base model, eager forward": None, "one adapter for all": [loras[0]] * n,
            f"{n} adapters, one each": loras}
    llamacpp_adapter = None
    if args.llamacpp:
        llamacpp_adapter = convert_for_llamacpp(work / "a0", args.hf_base)
        runs["one adapter for all (llama.cpp's GGUF file of it)"] = [LoRARequest("g", n + 1, str(llamacpp_adapter))] * n
    best = dict.fromkeys(runs, 0.0)
    for _ in range(args.runs):  # interleaved: a slow spell of the machine hits every run alike
        for name, lora in runs.items():
            eager = name.endswith("eager forward")
            faster, runner.step_runners = runner.step_runners, ([] if eager else runner.step_runners)
            best[name] = max(best[name], timed(llm, prompts, sp, lora))
            runner.step_runners = faster
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    llm.exit()
    print(f"model {model}; {n} sequences x {args.tokens} tokens after {args.prompt}-token prompts, rank {args.rank} "
          f"on {len(targets)} projections, lora_dtype {args.lora_dtype}; {os.cpu_count()} threads; tok/s: generated tokens per second of wall "
          f"time, prompts included; best of {args.runs}")
    print("\n| engine | run | tok/s | vs its base |\n|---|---|---|---|")
    base = best["base model"]
    for name, rate in best.items():
        print(f"| nano-vLLM | {name} | {rate:.1f} | {rate / base:.2f}x |")
    print(f"\npeak RSS {peak:.0f} MiB with {n} adapters resident")
    if llamacpp_adapter is not None:
        plain = llamacpp_rate(model, None, n, args)
        with_adapter = llamacpp_rate(model, llamacpp_adapter, n, args)
        print(f"| llama.cpp | base model | {plain:.1f} | 1.00x |")
        print(f"| llama.cpp | one adapter for all (--lora) | {with_adapter:.1f} | {with_adapter / plain:.2f}x |")


def convert_for_llamacpp(adapter: Path, hf_base: str | None) -> Path:
    """The PEFT adapter as llama.cpp's GGUF adapter (its own convert_lora_to_gguf.py; hf_base: the base
    model's HF folder, whose config it reads)."""
    import llamacpp_build
    from nanovllm.utils.cache import cache_root
    base = hf_base or str(cache_root() / "SmolLM2-135M-Instruct")
    return llamacpp_build.convert_lora(cache_root(), str(adapter), base, adapter.with_suffix(".gguf"), "f32")


def llamacpp_rate(model: str, adapter: Path | None, n: int, args) -> float:
    """llama-batched-bench's generated tokens per second of wall time (prompts included, as ours) on
    n sequences, with adapter applied to all (--lora) or none."""
    import llamacpp_build
    from bench_llamacpp import parse_batched_bench
    from nanovllm.utils.cache import cache_root
    bins = llamacpp_build.build_llamacpp(cache_root(), isa="native")
    logs = Path(tempfile.mkdtemp(prefix="bench-lora-llamacpp-"))
    out = logs / "batched-bench.jsonl"
    cmd = [str(bins["llama-batched-bench"]), "-m", model, "-c", str(n * (args.prompt + args.tokens) + 64),
           "-b", "2048", "-ub", "512", "-npp", str(args.prompt), "-ntg", str(args.tokens), "-npl", str(n),
           "-t", str(os.cpu_count()), "--output-format", "jsonl", *(["--lora", str(adapter)] if adapter else [])]
    best = 0.0
    for _ in range(args.runs):
        llamacpp_build.run_step("llama-batched-bench", cmd, logs / "batched-bench.log", stdout=out)
        row = parse_batched_bench(out.read_text())[n]
        best = max(best, n * args.tokens / row["t"])
    return best


if __name__ == "__main__":
    main()
