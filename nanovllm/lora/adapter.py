"""Reading an adapter: a PEFT folder (adapter_config.json + adapter_model.safetensors) or llama.cpp's
GGUF adapter file (loader/gguf_adapter.py), into one
LoRAAdapter: per target module its A [r, in] and its B [out, r] with the scale folded in (y += x A^T B^T), checked against the model's targets (what each linear layer
LoRA may touch, layers.lora_targets) before anything is queued. Safetensors only: a pickled
adapter_model.bin is refused, never loaded."""
import json
import math
import os
import re
from dataclasses import dataclass

import torch
import xxhash

from nanovllm.lora.request import LoRARequest

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
EXPERT_PARTS = ("gate_up_proj", "down_proj")  # the stacked experts' parameters (transformers' MoE blocks)
PEFT_PREFIX = "base_model.model."


class LoRAError(ValueError):
    """An adapter that cannot be used with this engine: the message names the adapter and what is wrong."""


@dataclass(frozen=True)
class LoRATarget:
    """A projection an adapter may update, by its checkpoint name (q_proj, not our stacked qkv_proj):
    the layer holding it (module), which of its stacked parts it is, and its full (unsharded) shape."""

    module: str
    part: int
    input_size: int
    output_size: int
    experts: int = 0  # > 0: a mixture of experts' stacked gate_up_proj (part 0) or down_proj (part 1)
    dense: bool = True  # the experts' weights are held dense (an adapter on quantized experts is refused)


@dataclass
class LoRAAdapter:
    """An adapter's weights, in fp32 on the host: name -> (A [r, in], B [out, r] x scale), and a digest of
    its files (the prefix cache keys of its requests start from it, so an adapter's KV never meets
    another's, nor the base model's, and a changed file never meets its old blocks)."""

    request: LoRARequest
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    rank: int
    digest: int

    @property
    def name(self) -> str:
        return self.request.lora_name


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the module name's end."""
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?(?:{key})", module):
            return value
    return default


def read_peft_config(request: LoRARequest) -> dict:
    path = os.path.join(request.lora_path, CONFIG_FILE)
    what = f"LoRA adapter {request.lora_name!r}"
    if not os.path.isdir(request.lora_path):
        raise LoRAError(f"{what}: {request.lora_path!r} is not a folder (a PEFT adapter folder holds "
                        f"{CONFIG_FILE} and {WEIGHTS_FILE}) nor a GGUF adapter file")
    if not os.path.isfile(path):
        raise LoRAError(f"{what}: {request.lora_path!r} has no {CONFIG_FILE}")
    try:
        with open(path, "rb") as f:
            config = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise LoRAError(f"{what}: {CONFIG_FILE} cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{what}: {CONFIG_FILE} is not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"{what}: peft_type {peft_type!r} is not LORA (only LoRA adapters are served)")
    if config.get("use_dora"):
        raise LoRAError(f"{what}: use_dora is set; DoRA adapters (a magnitude vector per output) are not supported")
    if config.get("modules_to_save"):
        raise LoRAError(f"{what}: modules_to_save {config['modules_to_save']} would replace whole modules of the "
                        "base model; only low-rank updates of linear projections are supported")
    if config.get("bias", "none") not in ("none", None):
        raise LoRAError(f"{what}: bias={config['bias']!r} trains biases; only bias='none' adapters are supported")
    params = config.get("target_parameters") or []
    unknown = [p for p in params if str(p).rsplit(".", 1)[-1] not in EXPERT_PARTS]
    if unknown:
        raise LoRAError(f"{what}: target_parameters {unknown}: only a mixture of experts' stacked "
                        f"{' / '.join(EXPERT_PARTS)} take adapters on parameters")
    if config.get("fan_in_fan_out"):
        raise LoRAError(f"{what}: fan_in_fan_out is set (GPT-2 Conv1D layers); the supported models' "
                        "projections are plain linear layers")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise LoRAError(f"{what}: {CONFIG_FILE} {key} must be a positive number, got {value!r}")
    return config


def load_peft(request: LoRARequest, targets: dict[str, LoRATarget], max_rank: int) -> LoRAAdapter:
    """A PEFT folder's adapter, checked against the model's targets and max_lora_rank."""
    from safetensors import SafetensorError, safe_open

    config = read_peft_config(request)
    what = f"LoRA adapter {request.lora_name!r}"
    weights_path = os.path.join(request.lora_path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        pickled = os.path.isfile(os.path.join(request.lora_path, "adapter_model.bin"))
        raise LoRAError(f"{what}: {request.lora_path!r} has no {WEIGHTS_FILE}" +
                        (" (adapter_model.bin is a pickle, which is never loaded: save the adapter with "
                         "safe_serialization=True)" if pickled else ""))
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(weights_path, framework="pt") as f:
            for key in f.keys():
                name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
                match = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", name)
                if match is None:
                    raise LoRAError(f"{what}: tensor {key!r} is not a lora_A / lora_B weight (embedding "
                                    "adapters, DoRA magnitudes and saved modules are not supported)")
                tensors.setdefault(match.group(1), {})[match.group(2)] = f.get_tensor(key)
    except SafetensorError as e:
        raise LoRAError(f"{what}: {WEIGHTS_FILE} is malformed: {e}") from None
    rslora = bool(config.get("use_rslora", False))
    pairs = {}
    for module, ab in tensors.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{what}: {module} has lora_{''.join(ab)} without its other half")
        name = parameter_name(module, ab["A"], ab["B"], targets, what)
        alpha = _pattern_value(config.get("alpha_pattern"), name, config["lora_alpha"])
        pairs[name] = (ab["A"], ab["B"], float(alpha))
    return make_adapter(request, pairs, rslora, targets, max_rank,
                        file_digest(os.path.join(request.lora_path, CONFIG_FILE), weights_path))


def parameter_name(module: str, a: torch.Tensor, b: torch.Tensor, targets: dict[str, "LoRATarget"],
                   what: str) -> str:
    """The target name of a saved module: itself, or for PEFT's wrappers of a MoE block's experts
    (target_parameters: each parameter wraps `experts` once more, `experts.lora_A`,
    `experts.base_layer.lora_A`, ... in an order the file does not state) `<experts>.<parameter>`,
    the parameter whose shape the pair has (gate_up_proj: hidden -> 2 x intermediate; down_proj:
    intermediate -> hidden)."""
    wrapped = module
    while wrapped.endswith(".base_layer"):
        wrapped = wrapped[: -len(".base_layer")]
    if wrapped.rsplit(".", 1)[-1] != "experts":
        return module
    for part in EXPERT_PARTS:
        target = targets.get(f"{wrapped}.{part}")
        if target is not None and a.dim() == 2 and b.dim() == 2 and \
                (a.shape[1], b.shape[0]) == (target.input_size, target.output_size):
            return f"{wrapped}.{part}"
    raise LoRAError(f"{what}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, the shape of "
                    f"none of the model's {wrapped}.{{{', '.join(EXPERT_PARTS)}}}")


def expert_factors(what: str, module: str, target: LoRATarget, a: torch.Tensor, b: torch.Tensor):
    """PEFT's factors of a stacked-experts parameter (ParamWrapper.get_delta_factors): lora_A
    [r E, in] and lora_B [out, r E] as each expert's A [E, r, in] and B [E, out, r]."""
    experts = target.experts
    if not target.dense:
        raise LoRAError(f"{what}: {module} updates experts held quantized; adapters on the experts need them "
                        "dense (an HF checkpoint's weights)")
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] % experts:
        raise LoRAError(f"{what}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, not [r x "
                        f"{experts} experts, in] and [out, r x {experts}]")
    r = a.shape[0] // experts
    return a.reshape(experts, r, a.shape[1]), b.reshape(b.shape[0], r, experts).permute(2, 0, 1)


def make_adapter(request: LoRARequest, pairs: dict[str, tuple[torch.Tensor, torch.Tensor, float]], rslora: bool,
                 targets: dict[str, LoRATarget], max_rank: int, digest: int) -> LoRAAdapter:
    """pairs: module -> (A [r, in], B [out, r], alpha), each checked against its target; the scale
    alpha / r (rsLoRA: alpha / sqrt(r)) folded into B."""
    what = f"LoRA adapter {request.lora_name!r}"
    if not pairs:
        raise LoRAError(f"{what}: holds no lora_A / lora_B weights")
    weights, rank = {}, 0
    for module in sorted(pairs):
        a, b, alpha = pairs[module]
        target = targets.get(module)
        if target is None:
            raise LoRAError(f"{what}: targets {module!r}, which this model has no linear projection LoRA applies "
                            f"to (it has e.g. {sorted(targets)[:4]})")
        if target.experts:
            a, b = expert_factors(what, module, target, a, b)
        elif a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoRAError(f"{what}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                            "not [r, in] and [out, r]")
        r = a.shape[-2]
        if (a.shape[-1], b.shape[-2]) != (target.input_size, target.output_size):
            raise LoRAError(f"{what}: {module} maps {a.shape[-1]} -> {b.shape[-2]} features, but the model's "
                            f"projection maps {target.input_size} -> {target.output_size} (an adapter of "
                            "another base model?)")
        if r > max_rank:
            raise LoRAError(f"{what}: rank {r} ({module}) is above max_lora_rank={max_rank}; start the engine "
                            f"with max_lora_rank >= {r}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAError(f"{what}: {module} holds infinities or NaNs")
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        weights[module] = (a.float().contiguous(), (b.float() * scale).contiguous())
        rank = max(rank, r)
    return LoRAAdapter(request, weights, rank, digest)


def file_digest(*paths: str) -> int:
    """xxh64 of the files' bytes, in order (nonzero: 0 is no salt)."""
    h = xxhash.xxh64()
    for path in paths:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.intdigest() or 1


def load_gguf(request: LoRARequest, targets: dict[str, LoRATarget], max_rank: int, hf_config) -> LoRAAdapter:
    """A llama.cpp GGUF adapter file's adapter (loader/gguf_adapter.py reads it), checked as a PEFT one."""
    from nanovllm.loader.gguf_adapter import read_gguf_adapter
    what = f"LoRA adapter {request.lora_name!r}"
    try:
        pairs = read_gguf_adapter(request.lora_path, what, hf_config)
    except ValueError as e:
        raise LoRAError(str(e)) from None
    return make_adapter(request, pairs, False, targets, max_rank, file_digest(request.lora_path))


def load_adapter(request: LoRARequest, targets: dict[str, LoRATarget], max_rank: int, hf_config=None) -> LoRAAdapter:
    """The adapter at request.lora_path: a GGUF adapter file (for a model of hf_config) or a PEFT folder."""
    from nanovllm.loader.gguf_adapter import is_gguf_file
    if not isinstance(request, LoRARequest):
        raise TypeError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
    if os.path.isfile(request.lora_path):
        if not is_gguf_file(request.lora_path):
            raise LoRAError(f"LoRA adapter {request.lora_name!r}: {request.lora_path!r} is a file but not a GGUF "
                            f"adapter; adapters are PEFT folders ({CONFIG_FILE} + {WEIGHTS_FILE}) or llama.cpp's "
                            "GGUF adapter files")
        return load_gguf(request, targets, max_rank, hf_config)
    if not os.path.exists(request.lora_path):
        raise LoRAError(f"LoRA adapter {request.lora_name!r}: {request.lora_path!r} does not exist")
    return load_peft(request, targets, max_rank)
