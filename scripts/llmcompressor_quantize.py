"""Quantize a HuggingFace folder with llm-compressor (the tool vLLM users quantize with), data-free:
oneshot with a QuantizationModifier over every Linear but lm_head (or with it), saved compressed
(compressed-tensors' pack-quantized / float-quantized formats), tokenizer files copied; and the
reference outputs of such a folder from transformers with the compressed-tensors version that
wrote it.

    python scripts/llmcompressor_quantize.py quantize SRC OUT SCHEME [SCHEME ...] [--dtype bfloat16]
        -> OUT/SCHEME for each scheme
    python scripts/llmcompressor_quantize.py reference PROMPTS_JSON MAX_TOKENS DIR [DIR ...]
        -> DIR.ref.json (greedy tokens) and DIR.ref.safetensors (per prompt: the
           generated steps' logits and the prompt's log-probabilities), in fp32

SCHEME: one of llm-compressor's preset names (W8A16, W4A16, W4A16_ASYM, FP8_DYNAMIC, ...) or a
weights-only scheme spelled out: `int{4|8}-{sym|asym}-{channel|group<N>}` or
`fp8-{tensor|channel|block<N>}`; `+head` after it quantizes lm_head too (no ignore list:
llm-compressor then unties a tied head from the embedding, which stays dense), `+head8` quantizes
lm_head to int8 per channel in a group of its own (as llama-quantize keeps the head of a 4-bit
file at 8 bits or more).
llm-compressor pins a transformers older than the project's, so this runs in its own virtual
environment (scripts/llmcompressor_env.sh makes it); nothing of the project is imported."""
import argparse
import glob
import json
import os
import shutil

import torch


def scheme_of(name: str):
    """A preset name as it is, or a spelled-out weights-only scheme as config_groups; with
    "+head8", config_groups of it and of an 8-bit per-channel lm_head (a second group, named)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme
    if name.endswith("+head8"):
        body = scheme_of(name.removesuffix("+head8"))
        body = {"body": preset_name_to_scheme(body, ["Linear"])} if isinstance(body, str) else body
        head = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        return {**body, "head": QuantizationScheme(targets=["lm_head"], weights=head)}
    if not name.startswith(("int", "fp8-")):
        return name
    if name.startswith("fp8-"):
        strategy = name[4:]
        block = [int(strategy[5:])] * 2 if strategy.startswith("block") else None
        args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block" if block else strategy,
                                block_structure=block)
    else:
        bits, sym, strategy = name[3:].split("-")
        group = int(strategy[5:]) if strategy.startswith("group") else None
        args = QuantizationArgs(num_bits=int(bits), type="int", symmetric=sym == "sym",
                                strategy="group" if group else "channel", group_size=group)
    return {"custom": QuantizationScheme(targets=["Linear"], weights=args)}


def quantize(src: str, out: str, schemes: list[str], dtype: str) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    for name in schemes:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype))
        scheme = scheme_of(name.removesuffix("+head"))
        ignore = [] if name.endswith(("+head", "+head8")) else ["lm_head"]
        if isinstance(scheme, str):
            modifier = QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore)
        else:
            modifier = QuantizationModifier(config_groups=scheme, ignore=ignore)
        oneshot(model=model, recipe=modifier)
        dst = os.path.join(out, name)
        model.save_pretrained(dst, save_compressed=True)
        for pattern in ("tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template*",
                        "generation_config.json"):
            for file in glob.glob(os.path.join(src, pattern)):
                shutil.copy(file, dst)


def reference(path: str, prompts: list[list[int]], max_tokens: int) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    tokens, tensors = [], {}
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
            prompt_logits = model(ids).logits[0, :-1].float()
        tokens.append(out.sequences[0, len(prompt):].tolist())
        tensors[f"logits.{i}"] = torch.stack(out.logits, 0)[:, 0].float().contiguous()
        tensors[f"prompt_logprobs.{i}"] = torch.log_softmax(prompt_logits, -1).contiguous()
    save_file(tensors, f"{path}.ref.safetensors")
    with open(f"{path}.ref.json", "w") as f:
        json.dump({"prompts": prompts, "tokens": tokens}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quantize")
    q.add_argument("src")
    q.add_argument("out")
    q.add_argument("schemes", nargs="+")
    q.add_argument("--dtype", default="bfloat16")
    r = sub.add_parser("reference")
    r.add_argument("prompts")
    r.add_argument("max_tokens", type=int)
    r.add_argument("paths", nargs="+")
    args = parser.parse_args()
    if args.command == "quantize":
        quantize(args.src, args.out, args.schemes, args.dtype)
    else:
        for path in args.paths:
            reference(path.rstrip("/"), json.loads(args.prompts), args.max_tokens)


if __name__ == "__main__":
    main()
