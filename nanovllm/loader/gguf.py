"""GGUF files as models: the config, the tokenizer and the tensors read from the file itself
(llama.cpp's format; gguf_reader.py, memory-mapped, nothing executed).

GGUFFile opens and checks a file once: its architecture (llama, qwen2, qwen3, and the mixtures of
experts qwen2moe, qwen3moe, whose experts come stacked in 3-D tensors), every tensor's type
(the block formats the C kernels multiply, cpu_quant.c) and that every tensor lies inside the
file, before anything is allocated. hf_config() builds the transformers config from the
metadata (each family's own names and settings: gguf_families.py, the hybrids' gguf_hybrid.py);
weights() yields the tensors under their HuggingFace names: block-quantized and
half-precision matrices as their raw rows (uint8 [rows, row bytes], multiplied as they are by
layers/quantization/gguf.py), F32 ones as float tensors. llama.cpp's converter permutes the rows
of llama's q and k projections for its rotary layout; they are put back in HF order here (whole
rows move, so quantized rows move as they are)."""
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.layers.quantization.block_formats import CONVERTED_FORMATS as CONVERTED
from nanovllm.layers.quantization.block_formats import NATIVE_FORMATS as NATIVE_TYPES
from nanovllm.layers.quantization.block_formats import block_shape
from nanovllm.loader import gguf_hybrid
from nanovllm.loader.gguf_reader import GGUFMetadata
from nanovllm.loader.gguf_families import (ARCHITECTURES, LAYER, MTP_LAST, PERMUTED_QK, architecture, family_config,
                                           hf_name, split_rows, stored_as_hf)

logger = logging.getLogger(__name__)

_open_files: dict[tuple[str, float], "GGUFFile"] = {}


def open_gguf(path: str) -> "GGUFFile":
    """The checked GGUFFile of path, parsed once per process (the reader builds every metadata
    array, a 49k-token vocabulary included, in about 2 s) until release_gguf(path)."""
    key = (os.path.abspath(str(path)), os.path.getmtime(path) if os.path.isfile(path) else 0.0)
    if key not in _open_files:
        _open_files.clear()  # one model at a time: never keep another file mapped
        _open_files[key] = GGUFFile(path)
    return _open_files[key]


def release_gguf(path: str) -> None:
    """Forget path's parsed file, unmapping it (called once its weights are loaded)."""
    for key in [k for k in _open_files if k[0] == os.path.abspath(str(path))]:
        _open_files.pop(key).close()


def is_gguf_path(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and str(path).lower().endswith(".gguf")


@dataclass(frozen=True)
class TensorInfo:
    gguf_name: str
    type_name: str           # lower-case GGUF type name, e.g. "q4_k"
    shape: tuple[int, ...]   # HuggingFace order: [rows, columns] for a matrix
    row_bytes: int           # bytes of one row as stored (0 for a vector)
    rows: tuple[int, int] | None = None  # a slice of the stored tensor's rows (one file tensor, several HF ones)


class GGUFFile:
    """A checked GGUF model file (ValueError naming what is wrong otherwise)."""

    def __init__(self, path: str):
        path = str(path)
        if not os.path.isfile(path):
            raise ValueError(f"GGUF file {path!r} does not exist")
        try:
            import gguf  # noqa: F401  (its type codes and block sizes)
        except ImportError as e:
            raise ValueError(f"reading {path!r} needs the `gguf` package: pip install 'nano-vllm[gguf]'") from e
        self.path = path
        try:
            self.reader = GGUFMetadata(path)
        except Exception as e:  # bad magic, truncated header or tensor data past the end
            raise ValueError(f"{path!r} is not a readable GGUF file: {type(e).__name__}: {e}") from e
        self.arch = self.field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"{path!r}: GGUF architecture {self.arch!r} is not supported; supported: "
                             f"{sorted(ARCHITECTURES)}")
        self.tensors: dict[str, TensorInfo] = {}
        self.converted: dict[str, list[str]] = {}  # file type -> the tensors converted at load
        unsupported, unknown = {}, []
        size = os.path.getsize(path)
        hybrid = self.arch in gguf_hybrid.ARCHITECTURES
        # a hybrid file's MTP head: its last layers (read back as the checkpoint's mtp.* tensors);
        # another family's (MTP_LAST) is left out
        first_mtp = self.target_layers() if hybrid or self.arch in MTP_LAST else None
        for t in self.reader.tensors:
            layer = LAYER.fullmatch(t.name)
            if self.arch in MTP_LAST and layer is not None and int(layer.group(1)) >= first_mtp:
                continue
            type_name = t.tensor_type.name.lower()
            if t.data_offset + t.n_bytes > size:
                raise ValueError(f"{path!r}: tensor {t.name} lies past the end of the file (truncated?)")
            name = hf_name(t.name, self.arch)
            if hybrid:
                name = gguf_hybrid.mtp_name(layer, name, first_mtp)
            if name is None:
                if t.name != "rope_freqs.weight":
                    unknown.append(t.name)
                continue
            if type_name not in NATIVE_TYPES and type_name not in CONVERTED:
                unsupported.setdefault(type_name, t.name)
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists the fastest dimension first
            if name.endswith("shared_expert_gate.weight") and len(shape) == 1:
                shape = (1, shape[0])  # a [hidden] vector in the file, HF's [1, hidden] linear
            if len(shape) == 3 and ".mlp.experts." not in name:
                raise ValueError(f"{path!r}: tensor {t.name} has 3 dimensions {shape}; only expert tensors do")
            row_bytes = t.n_bytes // int(np.prod(shape[:-1])) if len(shape) >= 2 else 0
            if type_name in CONVERTED:
                self.converted.setdefault(type_name, []).append(t.name)
                type_name = CONVERTED[type_name]
                per_block, nbytes = block_shape(type_name)
                row_bytes = shape[-1] // per_block * nbytes
            info = TensorInfo(t.name, type_name, shape, row_bytes)
            self.tensors.update(split_rows(self, name, info))
        if unsupported:
            listed = ", ".join(f"{k} (e.g. {v})" for k, v in sorted(unsupported.items()))
            raise ValueError(f"{path!r} holds tensor types {listed} that nano-vLLM does not multiply; supported: "
                             f"{', '.join(NATIVE_TYPES)} (and {', '.join(CONVERTED)}, converted at load)")
        if unknown:
            raise ValueError(f"{path!r} has tensors a {self.arch} model does not have: {unknown[:8]}")
        if any(t.name == "rope_freqs.weight" for t in self.reader.tensors):
            raise ValueError(f"{path!r} carries per-frequency rope factors (rope_freqs, Llama 3.1's rope scaling), "
                             "which are not supported for GGUF files yet; use the HF checkpoint")
        for key in ("rope.scaling.type",):
            value = self.field(f"{self.arch}.{key}", None)
            if value not in (None, "none") and not (self.arch == "gpt-oss" and value == "yarn"):
                raise ValueError(f"{path!r}: rope scaling {value!r} is not supported for GGUF files"
                                 f"{' of ' + self.arch if value == 'yarn' else ''}")

    def field(self, key: str, default=KeyError):
        value = self.reader.fields.get(key)
        if value is None:
            if default is KeyError:
                raise ValueError(f"{self.path!r} lacks the GGUF metadata key {key!r}")
            return default
        return value.tolist() if isinstance(value, np.ndarray) else value

    def hf_config(self):
        """The model's config as a plain transformers `PretrainedConfig` holding every setting the
        engine reads (the architecture-specific classes are not used: importing any of them pulls
        torch.distributed.tensor, sympy and accelerate in, ~60 MiB of a 400 MiB process)."""
        from transformers import PretrainedConfig
        a = self.arch
        heads = int(self.field(f"{a}.attention.head_count"))
        hidden = int(self.field(f"{a}.embedding_length"))
        vocab = self.field(f"{a}.vocab_size", None)
        if vocab is None:
            vocab = len(self.reader.fields["tokenizer.ggml.tokens"])
        kwargs = dict(
            hidden_size=hidden,
            intermediate_size=int(self.field(f"{a}.feed_forward_length", 0) or
                                  self.field(f"{a}.expert_feed_forward_length")),
            num_hidden_layers=self.target_layers(),
            num_attention_heads=heads,
            num_key_value_heads=self.kv_heads(heads),
            head_dim=int(self.field(f"{a}.attention.key_length", hidden // heads)),
            rms_norm_eps=float(self.field(f"{a}.attention.layer_norm_rms_epsilon")),
            rope_theta=float(self.field(f"{a}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(self.field(f"{a}.context_length")),
            vocab_size=int(vocab),
            tie_word_embeddings="lm_head.weight" not in self.tensors,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id", None),
            eos_token_id=self.field("tokenizer.ggml.eos_token_id", None),
            architectures=[architecture(self)],
            dtype="float32",
            hidden_act="silu",
        )
        return PretrainedConfig(**family_config(self, a, kwargs))

    def kv_heads(self, heads: int) -> int:
        """The attention layers' KV heads: head_count_kv, or the largest entry where the file gives one
        per layer (LFM2's, 0 on its short-convolution layers)."""
        kv = self.field(f"{self.arch}.attention.head_count_kv", heads)
        return int(max(kv) if isinstance(kv, list) else kv)

    def target_layers(self) -> int:
        """The model's layers: block_count, less an MTP head's (gguf_hybrid.mtp_layers)."""
        layers = int(self.field(f"{self.arch}.block_count"))
        mtp = self.arch in gguf_hybrid.ARCHITECTURES or self.arch in MTP_LAST
        return layers - gguf_hybrid.mtp_layers(self, self.arch) if mtp else layers

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of every tensor, copied out of the file (which is closed afterwards)."""
        heads = int(self.field(f"{self.arch}.attention.head_count"))
        kv_heads = self.kv_heads(heads)
        by_name = {t.name: t for t in self.reader.tensors}
        for kind, names in self.converted.items():
            logger.info("%s: %d %s tensors (e.g. %s) converted at load to %s, the nearest format the kernels "
                        "multiply", os.path.basename(self.path), len(names), kind.upper(), names[0],
                        CONVERTED[kind].upper())
        for name, info in self.tensors.items():
            data = by_name[info.gguf_name].data
            if info.rows is not None:
                data = np.asarray(data)[info.rows[0]: info.rows[1]]
            rows = info.shape[:-1] if len(info.shape) >= 2 else info.shape
            if by_name[info.gguf_name].tensor_type.name.lower() == "q5_k":
                data = q5_k_as_q5_1(np.asarray(data).reshape(-1, 176)).reshape(*rows, info.row_bytes)
            hybrid = self.arch in gguf_hybrid.ARCHITECTURES
            if (info.type_name == "f32" or (hybrid and len(info.shape) < 2)
                    or name.endswith(("conv1d.weight", ".conv.conv.weight"))):
                tensor = torch.from_numpy(np.array(data, dtype=np.float32).reshape(info.shape))
                tensor = stored_as_hf(self.arch, name, tensor)
            else:
                # the reader gives F16 / BF16 data as 16-bit values: their bytes, as for the blocks
                tensor = torch.from_numpy(np.array(data).view(np.uint8).reshape(*rows, info.row_bytes))
            if self.arch in PERMUTED_QK and (name.endswith("q_proj.weight") or name.endswith("k_proj.weight")):
                tensor = unpermute_rows(tensor, heads if "q_proj" in name else kv_heads)
            self.reader.release(by_name[info.gguf_name])  # (a tensor split into several is read again: mapped again)
            if len(info.shape) == 3 or (".mlp.experts." in name and name.endswith(".bias")):
                # experts.{gate,up,down}_proj.{weight,bias} -> experts.{e}.{part}.{weight,bias}
                base, part = name.split(".experts.")
                yield from ((f"{base}.experts.{e}.{part}", tensor[e]) for e in range(tensor.shape[0]))
                continue
            yield name, tensor

    def close(self) -> None:
        """Drop the reader and with it the file's mapping (the tensors yielded are copies)."""
        if self.reader is not None:
            self.reader.close()
        self.reader = None


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """A llama q or k projection back in HF row order: llama.cpp's converter interleaves the two
    halves of each head's rows for its rotary layout (HF row j * head_dim / 2 + i of a head is
    stored as row 2 i + j)."""
    rows = w.shape[0]
    if rows % (2 * heads):
        raise ValueError(f"cannot restore the row order of a {tuple(w.shape)} projection over {heads} heads")
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def q5_k_as_q5_1(blocks: np.ndarray) -> np.ndarray:
    """Q5_K super-blocks [n, 176] as Q5_1 blocks [n * 8, 24] (CONVERTED): the layouts are
    llama.cpp's (d, dmin, 12 bytes of 6-bit scales and mins, qh[32], qs[128] / d, m, qh[4], qs[16])."""
    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    p = blocks[:, 4:16].astype(np.uint8)
    sc = np.concatenate([p[:, 0:4] & 63, (p[:, 8:12] & 0x0F) | ((p[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([p[:, 4:8] & 63, (p[:, 8:12] >> 4) | ((p[:, 4:8] >> 6) << 4)], axis=1)
    qh, qs = blocks[:, 16:48], blocks[:, 48:176]
    # sub-block j: low 4 bits from qs[32 (j // 2) + l] >> 4 (j % 2), the fifth from bit j of qh[l]
    low = (qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = (low.reshape(n, 8, 32) | (high << 4)).reshape(n * 8, 32)
    out = np.empty((n * 8, 24), np.uint8)
    out[:, 0:2] = (d * sc).astype(np.float16).reshape(-1, 1).view(np.uint8)
    out[:, 2:4] = (-dmin * mn).astype(np.float16).reshape(-1, 1).view(np.uint8)
    out[:, 4:8] = np.packbits(q >> 4, axis=-1, bitorder="little")
    out[:, 8:24] = (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)
    return out
