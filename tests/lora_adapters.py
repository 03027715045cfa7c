"""PEFT adapters for the LoRA tests, made and run by PEFT itself (the reference): random A and B (PEFT's
own init leaves B zero, which would test nothing), saved with PeftModel.save_pretrained."""
import torch

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(base: str, path: str, seed: int, r: int = 8, alpha: float | None = None,
                      targets=ALL_PROJECTIONS, std: float = 0.1, **config) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(r=r, lora_alpha=alpha if alpha is not None else 2 * r, target_modules=list(targets),
                      init_lora_weights=False, **config)
    peft_model = get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    peft_model.save_pretrained(path)
    return path


def assert_like_peft(outputs, refs, what: str, atol: float = 1e-4) -> None:
    """Each output (LLM.generate with logprobs) has its PEFT reference's greedy tokens and the
    log-probability of each within atol (refs: peft_greedy's (tokens, log-probabilities) pairs)."""
    for i, (out, (tokens, logprobs)) in enumerate(zip(outputs, refs)):
        assert out["token_ids"] == tokens, f"{what}, prompt {i}"
        ours = torch.tensor([next(iter(step.values())) for step in out["logprobs"]])
        theirs = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
        assert torch.allclose(ours, theirs, atol=atol), f"{what}, prompt {i}: {(ours - theirs).abs().max()}"


def peft_greedy(base: str, adapter: str | None, prompts: list[list[int]], max_new_tokens: int):
    """(tokens, log-probabilities [new, vocab]) of each prompt, greedy, by transformers with the adapter
    applied by PEFT (None: the base model), one prompt at a time in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    results = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        logprobs = torch.log_softmax(torch.stack(out.logits, 0)[:, 0].float(), dim=-1)
        results.append((out.sequences[0, len(prompt):].tolist(), logprobs))
    return results
