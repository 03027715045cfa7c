"""Decode speed with LoRA adapters: N sequences each running its own adapter (rank R on every projection)
against the same N sequences on the base model alone, in one engine, one job at a time; and the peak
RSS with the N adapters resident.

    python scripts/bench_lora.py                      # the default model, 8 adapters of rank 16
    python scripts/bench_lora.py --model DIR --adapters 8 --rank 16 --tokens 64

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
    args = p.parse_args()
    from nanovllm import LLM, LoRARequest, SamplingParams
    from nanovllm.utils.default_model import default_model

    model = args.model or default_model()
    n = args.adapters
    llm = LLM(model, enable_lora=True, max_loras=n, max_lora_rank=args.rank, max_num_seqs=max(n, 8))
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
    base = max(timed(llm, prompts, sp, None) for _ in range(args.runs))
    mixed = max(timed(llm, prompts, sp, loras) for _ in range(args.runs))
    one = max(timed(llm, prompts, sp, [loras[0]] * n) for _ in range(args.runs))
    runner = llm.llm_engine.model_runner
    faster, runner.step_runners = runner.step_runners, []  # the eager forward adapter steps run in
    eager = max(timed(llm, prompts, sp, None) for _ in range(args.runs))
    runner.step_runners = faster
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"model {model}; {n} sequences x {args.tokens} tokens, rank {args.rank} on {len(targets)} projections; "
          f"{os.cpu_count()} threads")
    print("\n| run | tok/s | vs base |\n|---|---|---|")
    for name, rate in (("base model", base), ("base model, eager forward", eager), ("one adapter for all", one),
                       (f"{n} adapters, one each", mixed)):
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x |")
    print(f"\npeak RSS {peak:.0f} MiB with {n} adapters resident")
    llm.exit()


if __name__ == "__main__":
    main()
