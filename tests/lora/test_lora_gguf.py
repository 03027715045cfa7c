"""llama.cpp's GGUF adapters on GGUF base models, against transformers + PEFT on the same weights.

The base is a tiny GGUF written by llama.cpp's gguf package; transformers reads (dequantizes) it
into a HF folder, on which PEFT makes and runs a random adapter; llama.cpp's own
convert_lora_to_gguf.py writes that adapter as a GGUF file (its vendored copy, fetched by
`python scripts/llamacpp_build.py --source`, a step of the README's test command)."""
import sys
from pathlib import Path

import pytest
import torch

from gguf_helpers import write_tiny
from lora_adapters import assert_like_peft, make_peft_adapter, peft_greedy
from nanovllm import LLM, LoRARequest, SamplingParams
from nanovllm.lora.adapter import LoRAError
from nanovllm.utils.cache import cache_root

pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import llamacpp_build  # noqa: E402

PROMPTS = [[3, 5, 7, 9, 11, 13, 15, 17], [20, 30, 40, 50, 60]]
MAX_NEW = 8
FP32 = dict(dtype="float32", kv_cache_dtype="float32", kvcache_block_size=16)
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd")


@pytest.fixture(scope="module")
def converter() -> Path:
    llama = llamacpp_build.source_fetched(cache_root())
    if llama is None:
        pytest.skip("llama.cpp's converters are not fetched: run `python scripts/llamacpp_build.py --source` "
                    "(the README's test command does)")
    return llama


def hf_folder(gguf_file: Path, dest: Path) -> str:
    """transformers' reading of a GGUF file (its tensors dequantized), saved as a plain fp32 HF folder."""
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(str(dest))
    return str(dest)


@pytest.fixture(scope="module")
def case(converter, tmp_path_factory):
    """make(arch, base type, adapter outtype) -> (base GGUF, its HF folder, PEFT folder, GGUF adapter)."""
    made = {}

    def make(arch: str, base_type: str, outtype: str):
        key = (arch, base_type, outtype)
        if key not in made:
            root = tmp_path_factory.mktemp(f"{arch}-{base_type}-{outtype}")
            # head_dim 128: transformers' reading of a qwen3 file leaves head_dim at its default, 128
            base = write_tiny(root / "base.gguf", arch, {m: base_type for m in MATRICES}, heads=2, kv_heads=1, seed=3)
            hf = hf_folder(base, root / "hf")
            peft = make_peft_adapter(hf, str(root / "peft"), seed=1, r=4, alpha=6)
            adapter = llamacpp_build.convert_lora(cache_root(), peft, hf, root / "adapter.gguf", outtype)
            made[key] = (base, hf, peft, adapter)
        return made[key]
    return make


def test_llama_gguf_adapter_on_a_gguf_base_matches_peft(case):
    """F32 base and adapter: PEFT's greedy tokens and log-probabilities (1e-4). llama's q / k rows of
    lora_b come permuted by the converter, as the base's are: read back in HF order."""
    base, hf, peft, adapter = case("llama", "f32", "f32")
    refs = peft_greedy(hf, peft, PROMPTS, MAX_NEW)
    plain = peft_greedy(hf, None, PROMPTS, MAX_NEW)
    assert [t for t, _ in refs] != [t for t, _ in plain]  # the adapter changes the answer
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
    with LLM(str(base), enable_lora=True, **FP32) as llm:
        assert llm.llm_engine.model_runner.lora.dtype == torch.float32  # "auto" over dense layers: the model's
        for i, path in enumerate((adapter, peft)):  # llama.cpp's file and the PEFT folder it came from
            outs = llm.generate(PROMPTS, sp, use_tqdm=False, lora_request=LoRARequest(f"a{i}", i + 1, str(path)))
            assert_like_peft(outs, refs, str(path))


def teacher_forced(llm_or_model, sequence: list[int], lora=None) -> torch.Tensor:
    """log p(sequence[j] | sequence[:j]) for j >= 1: ours (an LLM) or transformers' (a model)."""
    if isinstance(llm_or_model, LLM):
        out = llm_or_model.generate([sequence], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                                    use_tqdm=False, lora_request=lora)[0]
        return torch.tensor([entry[tok] for entry, tok in zip(out["prompt_logprobs"][1:], sequence[1:])])
    with torch.no_grad():
        logp = torch.log_softmax(llm_or_model(torch.tensor([sequence])).logits[0].float(), -1)
    return logp[torch.arange(len(sequence) - 1), torch.tensor(sequence[1:])]


def test_qwen3_gguf_adapters_on_a_q8_0_base_within_quantization(case):
    """A Q8_0 base: on PEFT's greedy sequences, our log-probabilities with llama.cpp's F32 adapter
    equal ours with the PEFT folder it came from; with its Q8_0 adapter (--outtype q8_0) they are
    transformers + PEFT's on the dequantized base within what Q8_0 rounding moves: about the base
    model's own error (our kernels round activations to 8 bits), far below the adapter's effect. The
    slots are int8 ("auto" over a quantized base): the F32 file's equality with the folder holds
    because both are rounded alike."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base, hf, peft, adapter_f32 = case("qwen3", "q8_0", "f32")
    adapter_q8 = case("qwen3", "q8_0", "q8_0")[3]
    refs = peft_greedy(hf, peft, PROMPTS, MAX_NEW)
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32), peft).eval()
    plain = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with LLM(str(base), enable_lora=True, **FP32) as llm:
        assert llm.llm_engine.model_runner.lora.dtype == torch.int8  # "auto" over a quantized base
        from nanovllm.lora.layers import slot_dtype  # (where the Triton kernels run, the model's dtype)
        assert slot_dtype(None, llm.llm_engine.model_runner.model, torch.bfloat16, triton=True) == torch.bfloat16
        for prompt, (tokens, _) in zip(PROMPTS, refs):
            seq = prompt + tokens
            folder = teacher_forced(llm, seq, LoRARequest("peft", 1, peft))
            assert torch.allclose(teacher_forced(llm, seq, LoRARequest("f32", 2, str(adapter_f32))), folder, atol=1e-5)
            ours = teacher_forced(llm, seq, LoRARequest("q8", 3, str(adapter_q8)))
            theirs, without = teacher_forced(reference, seq), teacher_forced(plain, seq)
            base_error = (teacher_forced(llm, seq) - without).abs().max().item()
            error, effect = (ours - theirs).abs().max().item(), (theirs - without).abs().max().item()
            assert error < 1.5 * base_error + 0.03 and effect > 20 * error, (error, base_error, effect)


def test_gguf_adapters_are_checked(case, tmp_path):
    """A base model file given as an adapter, an adapter of another architecture, a file that is not
    GGUF: each a clear error naming the adapter, before anything runs."""
    llama_base, _, _, llama_adapter = case("llama", "f32", "f32")
    qwen_base, _, _, qwen_adapter = case("qwen3", "q8_0", "f32")
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not an adapter")
    with LLM(str(qwen_base), enable_lora=True, **FP32) as llm:
        for path, message in ((llama_base, "not a LoRA adapter"), (llama_adapter, "architecture 'llama'"),
                              (junk, "not a GGUF adapter")):
            with pytest.raises(LoRAError, match=message) as info:
                llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False,
                             lora_request=LoRARequest("bad", 7, str(path)))
            assert "'bad'" in str(info.value)
        out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False,
                           lora_request=LoRARequest("good", 8, str(qwen_adapter)))
        assert len(out[0]["token_ids"]) == 2
