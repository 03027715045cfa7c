"""SmolLM3 against transformers (fp32, log-probabilities within 1e-4): its NoPE layers (every
`no_rope_layer_interval`-th layer leaves q and k unrotated), with and without sliding windows on those
layers, through whole and chunked prefills, prefix-cache hits, the C decode step, preemption and
TP=2; and llama.cpp's GGUF file of it, written by its own convert_hf_to_gguf.py."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import save_decisive
from lora_adapters import assert_like_peft, peft_greedy
from nanovllm import LLM, SamplingParams
from sliding_checkpoints import check_tp2_equals_tp1

VOCAB, MAX_NEW = 256, 12
FP32 = dict(dtype="float32", kv_cache_dtype="float32", kvcache_block_size=16, cpu_kvcache_bytes=8 << 20)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
PROMPTS = [[3 + (11 * i + 5 * n) % 250 for i in range(n)] for n in (1, 9, 23, 45)]
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2, pad_token_id=0)
KINDS = {
    # layers 1 and 3 NoPE (an interval of 2)
    "nope": dict(num_hidden_layers=4, no_rope_layer_interval=2),
    # the default interval (4: layer 3), its NoPE layers sliding over 8 tokens (transformers' layer_types)
    "nope-sliding": dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=8),
}
# llama.cpp's smollm3 files: the default interval, no windows (its smollm3 graph has none)
GGUF_KIND = dict(num_hidden_layers=4)


def make_smollm3(path: str, kind: str) -> str:
    import transformers
    config = transformers.SmolLM3Config(**SHAPE, **(GGUF_KIND if kind == "gguf" else KINDS[kind]))
    config.architectures = ["SmolLM3ForCausalLM"]
    torch.manual_seed(5)
    return save_decisive(transformers.SmolLM3ForCausalLM(config), path, VOCAB)


@pytest.fixture(scope="module", params=list(KINDS))
def checkpoint(request, tmp_path_factory):
    path = make_smollm3(str(tmp_path_factory.mktemp(request.param)), request.param)
    return path, peft_greedy(path, None, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("engine", [dict(), dict(max_num_batched_tokens=16, max_num_seqs=4)], ids=["whole", "chunked"])
def test_greedy_and_logprobs_match_transformers(checkpoint, engine):
    """Twice: the second pass from prefix-cache hits. The decode steps run the C step's one call,
    whose layers know which of them are NoPE."""
    from nanovllm.executor.cpu_decode import FusedDecode
    path, refs = checkpoint
    with LLM(path, **FP32, **engine) as llm:
        runner = llm.llm_engine.model_runner
        assert [layer.self_attn.use_rope for layer in runner.model.model.layers] == \
            [bool(f) for f in llm.llm_engine.config.hf_config.no_rope_layers]
        assert runner.step_runner(FusedDecode) is not None
        for attempt in ("first", "second"):
            assert_like_peft(llm.generate(PROMPTS, GREEDY, use_tqdm=False), refs, f"{attempt} pass")


def test_the_nope_layers_matter(checkpoint, monkeypatch):
    """With every layer rotating (the NoPE layers switched off), the answers are not transformers'."""
    from nanovllm.models import smollm3
    path, refs = checkpoint
    monkeypatch.setattr(smollm3, "rope_layers", lambda config: [True] * config.num_hidden_layers)
    with LLM(path, **FP32) as llm:
        with pytest.raises(AssertionError):
            assert_like_peft(llm.generate(PROMPTS, GREEDY, use_tqdm=False), refs, "all layers rotated")


def test_tp2_matches_tp1_with_prefix_hits_chunks_and_preemption(tmp_path):
    check_tp2_equals_tp1(make_smollm3(str(tmp_path), "nope-sliding"))


def test_bad_no_rope_layers_are_named():
    from types import SimpleNamespace
    from nanovllm.models.smollm3 import rope_layers
    assert rope_layers(SimpleNamespace(num_hidden_layers=8, no_rope_layers=None)) == [True, True, True, False] * 2
    with pytest.raises(ValueError, match="no_rope_layers must hold a 0 or 1 for each of the 4 layers"):
        rope_layers(SimpleNamespace(num_hidden_layers=4, no_rope_layers=[1, 1, 0]))


def test_llamacpp_gguf_file_matches_transformers(tmp_path):
    """llama.cpp's convert_hf_to_gguf.py writes the checkpoint as a `smollm3` file (q / k rows permuted,
    no NoPE list: llama.cpp takes every 4th layer): ours reads it back to transformers' answers."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import llamacpp_build
    from nanovllm.utils.cache import cache_root
    llama = llamacpp_build.source_fetched(cache_root())
    if llama is None:
        pytest.skip("llama.cpp's converters are not fetched: run `python scripts/llamacpp_build.py --source` "
                    "(the README's test command does)")
    path = make_smollm3(str(tmp_path / "hf"), "gguf")
    # The converter reads a SentencePiece vocabulary without matching its pre-tokenizer against the
    # ones it knows (the test tokenizer.json's is none of them): a tiny one trained here, its pieces
    # padded by the converter to the model's 256 tokens (the tests speak in token ids).
    import sentencepiece
    english = Path(__file__).resolve().parents[1] / "data" / "english.txt"
    sentencepiece.SentencePieceTrainer.train(input=str(english), model_prefix=f"{path}/tokenizer", vocab_size=200,
                                             model_type="bpe", minloglevel=2)
    out = tmp_path / "smollm3-f32.gguf"
    done = subprocess.run([sys.executable, str(llama / "convert_hf_to_gguf.py"), path, "--outtype", "f32",
                           "--outfile", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    refs = peft_greedy(path, None, PROMPTS, MAX_NEW)
    with LLM(str(out), **FP32) as llm:
        assert llm.llm_engine.config.hf_config.architectures == ["SmolLM3ForCausalLM"]
        assert [layer.self_attn.use_rope for layer in llm.llm_engine.model_runner.model.model.layers] == \
            [True, True, True, False]
        assert_like_peft(llm.generate(PROMPTS, GREEDY, use_tqdm=False), refs, "llama.cpp's file")
