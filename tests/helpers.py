"""Test helpers: tiny random checkpoints made with transformers, and an offline tokenizer."""
import os

import torch

WORDS = ("the quick brown fox jumps over a lazy dog while seven bright stars shine above "
         "old quiet rivers and small green hills near the city of paris where people talk").split()


def save_tokenizer(tok, path: str):
    """Wrap a `tokenizers` Tokenizer as an HF fast tokenizer with our special tokens and a tiny chat
    template, and save it into path."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                   bos_token="<bos>", pad_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant {% endif %}")
    fast.save_pretrained(path)
    return fast


def make_tokenizer(path: str, vocab_size: int = 256):
    """A word-level tokenizer with a byte-free vocabulary and a tiny chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    specials = ["<unk>", "<eos>", "<bos>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    i = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"w{i}", len(vocab))
        i += 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return save_tokenizer(tok, path)


def make_byte_tokenizer(path: str):
    """A byte-level tokenizer: one token per byte (259 with <unk>, <eos>, <bos>), no merges, so any
    text is a token sequence and decoding is exact (what grammar tests need); same chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(["<unk>", "<eos>", "<bos>"])}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return save_tokenizer(tok, path)


QWEN3_SHAPES = {
    # GQA 4:2, head_dim (32) != hidden / heads (16), no qkv bias, untied head.
    "gqa": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, attention_bias=False, tie_word_embeddings=False),
    # MHA with qkv bias and tied embeddings.
    "bias_tied": dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=24, attention_bias=True, tie_word_embeddings=True),
    # Every input size a multiple of 128 on each of two ranks (quantization groups of 128 split whole).
    "groups": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, attention_bias=False, tie_word_embeddings=False),
}


def make_qwen3(path: str, shape: str = "gqa", vocab_size: int = 256, seed: int = 0, **overrides) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    os.makedirs(path, exist_ok=True)
    kwargs = dict(QWEN3_SHAPES[shape], vocab_size=vocab_size, max_position_embeddings=512,
                  rms_norm_eps=1e-6, rope_theta=10000.0, eos_token_id=1, bos_token_id=2,
                  pad_token_id=0)
    kwargs.update(overrides)
    config = Qwen3Config(**kwargs)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # larger-than-default weights give peaked, decisive next-token logits
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(path, vocab_size)
    return path


def save_decisive(model, path: str, vocab_size: int) -> str:
    """model saved to path with a test tokenizer, its matrices (and stacked experts) and its
    all-zero vectors (biases) redrawn from N(0, 0.1): larger-than-default weights give decisive
    next-token logits (and routings), nonzero biases count."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 or p.abs().sum() == 0:
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    make_tokenizer(path, vocab_size)
    return path


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int, mask_eos: bool = False, **load):
    """Greedy tokens and per-step logits from transformers, one prompt at a time (fp32).

    mask_eos=True forces max_new_tokens with min_new_tokens, which masks EOS out of the choice;
    mask_eos=False takes the plain argmax and runs on past EOS, as the engine's ignore_eos does.
    load: more from_pretrained arguments."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load)
    model.eval()
    length = {"min_new_tokens": max_new_tokens} if mask_eos else {"eos_token_id": None}
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0, **length)
        tokens = out.sequences[0, len(prompt):].tolist()
        logits = torch.stack(out.logits, 0)[:, 0]  # [num_new, vocab]
        results.append((tokens, logits))
    return results


def check_tokens_close(ours: list[list[int]], ref: list[tuple[list[int], "torch.Tensor"]],
                       our_logprobs: list["torch.Tensor"] | None = None, k: int = 5) -> int:
    """vLLM's rule: outputs equal, or at the first difference each side's token is in the other's
    top-k. Our top-k needs our logits; without them only the reference side is checked.
    Returns how many outputs matched exactly."""
    exact = 0
    for i, (tokens, (ref_tokens, ref_logits)) in enumerate(zip(ours, ref)):
        if tokens == ref_tokens:
            exact += 1
            continue
        pos = next((j for j, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
        assert pos is not None, f"prompt {i}: {len(tokens)} tokens vs the reference's {len(ref_tokens)}"
        ref_top = ref_logits[pos].topk(k).indices.tolist()
        assert tokens[pos] in ref_top, f"prompt {i}: token {tokens[pos]} at {pos} not in HF top-{k} {ref_top}"
        if our_logprobs is not None:
            our_top = our_logprobs[i][pos].topk(k).indices.tolist()
            assert ref_tokens[pos] in our_top, f"prompt {i}: HF token not in our top-{k}"
    return exact


# ---- GGUF block formats -----------------------------------------------------------------------------
# Byte offsets of each block's fp16 fields (d, m / dmin), which random bytes must not fill with
# infinities or NaNs.
HALF_FIELDS = {"q8_0": [0], "q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q4_k": [0, 2], "q5_k": [0, 2],
               "q6_k": [208], "q2_k": [80, 82], "q3_k": [108],
               **{name: [0] for name in ("iq4_nl", "iq4_xs", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s")},
               "iq1_m": []}  # (IQ1_M's fp16 d is the top nibbles of its four scale words: iq1_m_scales)


def iq1_m_scales(blocks, d):
    """IQ1_M blocks [n, 56] with their fp16 d set to d [n] (the top nibbles of the words at 48..55)."""
    import numpy as np
    bits = d.astype(np.float16).view(np.uint16).astype(np.uint16)
    words = blocks[:, 48:56].copy().view(np.uint16)
    for i in range(4):
        words[:, i] = (words[:, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
    blocks[:, 48:56] = words.view(np.uint8)
    return blocks


def qtype(name: str):
    import gguf
    return gguf.GGMLQuantizationType[name.upper()]


def random_weights(name: str, n: int, k: int, rng, unit_scales: bool = False, std: float | None = None):
    """n x k weights of a GGUF block format (or f16) as raw rows (uint8 [n, row bytes]): random
    values, sane fp16 scales (1 and 0 / 1 with unit_scales, so that every weight is an integer;
    std: scaled so that the weights have about that standard deviation)."""
    import gguf
    import numpy as np
    if name == "f16":
        return np.ascontiguousarray(rng.standard_normal((n, k)).astype(np.float16)).view(np.uint8).reshape(n, 2 * k)
    size, nbytes = gguf.GGML_QUANT_SIZES[qtype(name)]
    blocks = rng.integers(0, 256, size=(n * k // size, nbytes), dtype=np.uint8)
    if name == "mxfp4":  # an E8M0 exponent byte: scales 2^(e - 128) on the doubled E2M1 codes
        blocks[:, 0] = 128 if unit_scales else rng.integers(118, 124, len(blocks))
        if std is not None:
            factor = std / gguf.quants.dequantize(blocks.reshape(n, -1), qtype(name)).std()
            blocks[:, 0] = np.clip(blocks[:, 0].astype(np.int64) + int(np.round(np.log2(factor))), 2, 254)
        return blocks.reshape(n, k // size * nbytes)
    for i, offset in enumerate(HALF_FIELDS[name]):
        if unit_scales:
            value = np.full(len(blocks), 1.0 if i == 0 else float(rng.integers(0, 3)), np.float16)
        else:
            value = (rng.uniform(0.002, 0.02, len(blocks)) * (1 if i == 0 else rng.choice([-1, 1]))).astype(np.float16)
        blocks[:, offset:offset + 2] = value.view(np.uint8).reshape(-1, 2)
    if name == "iq1_m":
        blocks = iq1_m_scales(blocks, np.full(len(blocks), 1.0) if unit_scales else rng.uniform(0.002, 0.02, len(blocks)))
    if name == "q6_k" and unit_scales:
        blocks[:, 192:208] = rng.integers(-4, 5, size=(len(blocks), 16)).astype(np.int8).view(np.uint8)
    if std is not None and name in ("q4_k", "q5_k"):
        # model-like blocks: sub-block mins of 0-3 against scales of 0-63 (random bytes give mins as
        # large as the scales, so each sub-block a large common offset)
        blocks[:, 8:12] &= 0x03
        blocks[:, 12:16] &= 0x3F
    if std is not None:  # every weight is linear in the block's fp16 fields
        factor = std / gguf.quants.dequantize(blocks.reshape(n, -1), qtype(name)).std()
        for offset in HALF_FIELDS[name]:
            field = blocks[:, offset:offset + 2].copy().view(np.float16)
            blocks[:, offset:offset + 2] = (field.astype(np.float32) * factor).astype(np.float16).view(np.uint8)
        if name == "iq1_m":
            words = blocks[:, 48:56].copy().view(np.uint16)
            d = sum(((words[:, i] >> 12) << (4 * i)) for i in range(4)).astype(np.uint16).view(np.float16)
            blocks = iq1_m_scales(blocks, d.astype(np.float32) * factor)
    return blocks.reshape(n, k // size * nbytes)


def gguf_writer(path: str, arch: str, config, layers: int | None = None):
    """A gguf.GGUFWriter for `arch` holding the metadata every decoder's file states, from an HF
    config: layers (the config's, or `layers`), context, width, heads and KV heads, RMS eps, rope
    base, vocabulary size."""
    import gguf
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(config.num_hidden_layers if layers is None else layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    w.add_vocab_size(config.vocab_size)
    return w


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on CPU: replay re-runs the model over the static buffers
    with the Context seen at capture, which is what a real graph replays."""

    def __init__(self):
        self.replays = 0
        self.pool = self.model = self.buffers = self.context = self.graph_bs = None

    def replay(self):
        self.replays += 1
        from nanovllm.utils.context import forward_context
        buf = self.buffers
        with torch.inference_mode(), forward_context(self.context):
            buf.outputs[:self.graph_bs] = self.model(buf.input_ids[:self.graph_bs], buf.positions[:self.graph_bs])


def fake_cuda_graphs(monkeypatch) -> list[FakeGraph]:
    """torch.cuda's graph API faked on CPU (capture records the Context; the test then sets each
    graph's model and buffers): the graphs captured, in order."""
    import contextlib
    from nanovllm.utils.context import get_context
    captures = []

    @contextlib.contextmanager
    def fake_capture(graph, pool=None):
        graph.pool, graph.context = pool, get_context()
        graph.graph_bs = graph.context.slot_mapping.shape[0]
        captures.append(graph)
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "the-pool")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    return captures
