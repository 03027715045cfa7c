"""A checkpoint opened once: a HuggingFace folder (config.json, *.safetensors, tokenizer files) or a
.gguf file. Checkpoint answers what the engine asks of it, whatever its kind: the HF config, the
tokenizer, the end-of-sequence ids, the weight format (a QuantizationConfig, built once, from
config.json or the file's tensor index), and the weights as (checkpoint name, tensor) pairs.
Config opens it (and carries it, pickled, to the tensor-parallel workers: facts only, no open file);
the tokenizer and the weights are read where they are used."""
import functools
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from nanovllm.layers.quantization import QuantizationConfig, quant_config_for_model
from nanovllm.loader.gguf import is_gguf_path, open_gguf, release_gguf
from nanovllm.loader.safetensors import safetensors_weights

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _looks_like_hub_id(model: str) -> bool:
    """Whether `model` is spelled like a HuggingFace hub id ("owner/name"), not like a path."""
    parts = model.split("/")
    return (len(parts) == 2 and all(p and p not in (".", "..") for p in parts)
            and all(c.isalnum() or c in "-_." for p in parts for c in p))


def _missing_folder_message(model: str) -> str:
    message = f"model folder {model!r} does not exist or is not a directory"
    if _looks_like_hub_id(model):
        # vLLM downloads hub ids; users coming from it type one first.
        message += (f"; it looks like a HuggingFace hub id, and nano-vLLM does not download from the hub: "
                    f"pass a local checkpoint folder (huggingface_hub.snapshot_download({model!r}) "
                    "downloads one and returns its path) or use LLM.default() for the default model")
    return message


def load_hf_config(model: str):
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path to a checkpoint folder or a .gguf file, got {type(model).__name__}")
    model = str(model)
    if is_gguf_path(model):
        return open_gguf(model).hf_config()  # ValueError for a missing, malformed or unsupported file
    if not os.path.isdir(model):
        raise ValueError(_missing_folder_message(model))
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"model folder {model!r} has no config.json")
    if not any(f.endswith(".safetensors") for f in os.listdir(model)):
        raise ValueError(f"model folder {model!r} has no *.safetensors weights "
                         "(only safetensors checkpoints are loaded)")
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(model)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read config.json of {model!r}: {e}") from e


# Sampling defaults a model states (vLLM applies them to requests that leave the field unset): the
# generation_config.json fields (-> SamplingParams' names; vLLM reads max_new_tokens as the default
# max_tokens), and a GGUF file's general.sampling.* metadata.
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                      "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                      "general.sampling.penalty_repeat": "repetition_penalty"}


def read_generation_config(folder: str) -> dict | None:
    """folder's generation_config.json (None without the file). ValueError for a file that is not
    a JSON object."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def generation_config_defaults(folder: str) -> dict | None:
    """The sampling fields of folder's generation_config.json ({} without any; None without the
    file)."""
    data = read_generation_config(folder)
    if data is None:
        return None
    return {field: data[name] for name, field in GENERATION_CONFIG_FIELDS.items() if data.get(name) is not None}


class Checkpoint:
    """The checkpoint at path, opened and checked once (ValueError naming what is wrong)."""

    def __init__(self, path: str):
        self.hf_config = load_hf_config(path)
        self.path = str(path)
        self.is_gguf = is_gguf_path(self.path)
        # A GGUF file's tensor index (HF name -> (lower-case type, shape)); None for a folder.
        self.gguf_tensors = ({name: (info.type_name, info.shape) for name, info in open_gguf(self.path).tensors.items()}
                             if self.is_gguf else None)

    @property
    def name(self) -> str:
        return os.path.basename(self.path.rstrip("/"))

    def quant_config(self, quantization: str | None, packed_modules_mapping: dict,
                     input_planes: int = 0) -> QuantizationConfig:
        """The weight format the layers are built in (layers/quantization, quant_config_for_model)."""
        return quant_config_for_model(self.path, self.hf_config, quantization, packed_modules_mapping,
                                      self.gguf_tensors, input_planes)

    def eos_token_ids(self) -> frozenset[int]:
        """config.json's eos_token_id and generation_config.json's (a GGUF file's from its metadata)."""
        ids: set[int] = set()

        def add(value) -> None:
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(v for v in value if isinstance(v, int))

        add(getattr(self.hf_config, "eos_token_id", None))
        if not self.is_gguf:
            add((read_generation_config(self.path) or {}).get("eos_token_id"))
        return frozenset(ids)

    def sampling_defaults(self) -> dict:
        """The sampling settings the model states: generation_config.json's, or a GGUF file's
        general.sampling.* metadata ({} when it states none)."""
        if not self.is_gguf:
            return generation_config_defaults(self.path) or {}
        gguf = open_gguf(self.path)
        found = {name: gguf.field(key, None) for key, name in GGUF_SAMPLING_KEYS.items()}
        return {name: value.item() if hasattr(value, "item") else value
                for name, value in found.items() if value is not None}

    @functools.cached_property
    def pooling(self) -> str:
        """How an embedding pools the prompt: a sentence-transformers folder's 1_Pooling/config.json
        says (mean, CLS or last token); otherwise the last token, as vLLM pools decoder models."""
        path = os.path.join(self.path, "1_Pooling", "config.json")
        if self.is_gguf or not os.path.isfile(path):
            return "last"
        with open(path) as f:
            modes = json.load(f)
        for key, method in (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                            ("pooling_mode_cls_token", "cls")):
            if modes.get(key):
                return method
        raise ValueError(f"{path} asks for a pooling other than last token, mean or CLS: {modes}")

    def load_tokenizer(self) -> Any:
        """The HF tokenizer (a GGUF file's own, built by transformers from its metadata), or None for
        a weights-only folder (then prompts must be token ids)."""
        if self.is_gguf:
            if open_gguf(self.path).field("tokenizer.ggml.model", None) is None:
                logger.info("%s has no vocabulary: prompts must be token ids and outputs carry no text", self.path)
                return None
            # The class AutoTokenizer picks for a GGUF file, without the model config it would load to
            # pick it (whose import costs ~60 MiB, see GGUFFile.hf_config)
            from transformers import PreTrainedTokenizerFast
            return PreTrainedTokenizerFast.from_pretrained(os.path.dirname(os.path.abspath(self.path)),
                                                           gguf_file=os.path.basename(self.path))
        if not any(os.path.isfile(os.path.join(self.path, f)) for f in _TOKENIZER_FILES):
            # INFO, not a warning: weights-only folders are meant for token-id prompts (bench.py's), and
            # a string prompt or stop string then fails with a ValueError that says why.
            logger.info("%s has no tokenizer files: prompts must be token ids and outputs carry no text", self.path)
            return None
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(self.path)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor as (checkpoint name, tensor); a GGUF file is unmapped once they are read."""
        if not self.is_gguf:
            yield from safetensors_weights(self.path)
            return
        try:
            yield from open_gguf(self.path).weights()
        finally:
            release_gguf(self.path)
