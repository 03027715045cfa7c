"""The structures the C kernels and Python both lay out (kernels/cpu_kernels.h), as ctypes
structures, and the check that a loaded library speaks this ABI: its version and the size of every
structure. cpu_kernels.py builds and loads the library; the executor fills these."""
import ctypes

c_int64, c_float, c_void_p = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


# ---- the C structures (cpu_kernels.h); load() checks their sizes and offsets against the library's ---
class Linear(ctypes.Structure):
    _fields_ = [("data", c_void_p), ("bias", c_void_p), ("scales", c_void_p), ("n", c_int64), ("k", c_int64),
                ("type", c_int64), ("row_bytes", c_int64), ("next", c_void_p), ("input_planes", c_int64)]


class MoeExperts(ctypes.Structure):
    _fields_ = [("gate_up", ctypes.POINTER(Linear)), ("down", ctypes.POINTER(Linear)), ("num_experts", c_int64),
                ("top_k", c_int64), ("renormalize", c_int64), ("hidden", c_int64), ("intermediate", c_int64),
                ("router", Linear), ("shared_gate_up", Linear), ("shared_down", Linear), ("shared_gate", Linear),
                ("activation", c_int64), ("alpha", c_float), ("limit", c_float),
                ("n_group", c_int64), ("topk_group", c_int64), ("correction_bias", c_void_p), ("routed_scale", c_float)]

# MoeExperts.activation (cpu_kernels.h): the experts' activation by the name layers/moe.py gives it.
MOE_ACTIVATIONS = {"silu": 0, "swigluoai": 1}


class DeltaNetLayer(ctypes.Structure):
    _fields_ = [("conv_w", c_void_p), ("conv_state", c_void_p), ("state", c_void_p), ("A_log", c_void_p),
                ("dt_bias", c_void_p), ("norm", c_void_p), ("nk", c_int64), ("nv", c_int64), ("dk", c_int64),
                ("dv", c_int64), ("K", c_int64), ("tiled", c_int64)]


class ShortConvLayer(ctypes.Structure):
    _fields_ = [("conv_w", c_void_p), ("conv_bias", c_void_p), ("conv_state", c_void_p), ("C", c_int64),
                ("K", c_int64)]


class Mamba2Layer(ctypes.Structure):
    _fields_ = [("proj", Linear), ("out", Linear), ("conv_w", c_void_p), ("conv_b", c_void_p), ("conv_state", c_void_p), ("ssm", c_void_p),
                ("A_log", c_void_p), ("D", c_void_p), ("dt_bias", c_void_p), ("norm", c_void_p), ("heads", c_int64),
                ("p", c_int64), ("n", c_int64), ("groups", c_int64), ("heads_per_group", c_int64), ("K", c_int64),
                ("norm_width", c_int64), ("norm_before_gate", c_int64), ("dt_min", c_float), ("dt_max", c_float)]


class DecoderLayer(ctypes.Structure):
    _fields_ = [("input_norm", c_void_p), ("post_norm", c_void_p), ("q_norm", c_void_p), ("k_norm", c_void_p),
                ("qkv", Linear), ("o", Linear), ("gate_up", Linear), ("down", Linear),
                ("k_cache", c_void_p), ("v_cache", c_void_p), ("in_c", c_int64), ("moe", ctypes.POINTER(MoeExperts)),
                ("window", c_int64), ("sinks", c_void_p), ("kv_group", c_int64), ("attn_gate", c_int64),
                ("linear", ctypes.POINTER(DeltaNetLayer)), ("no_rope", c_int64),
                ("short_conv", ctypes.POINTER(ShortConvLayer)), ("mamba2", ctypes.POINTER(Mamba2Layer))]


class DecoderModel(ctypes.Structure):
    _fields_ = [("num_layers", c_int64), ("hidden", c_int64), ("num_heads", c_int64), ("num_kv_heads", c_int64),
                ("head_dim", c_int64), ("intermediate", c_int64), ("block_size", c_int64), ("kv_type", c_int64),
                ("eps", c_float),
                ("scale", c_float), ("rotary_dim", c_int64), ("cos_sin", c_void_p), ("final_norm", c_void_p),
                ("layers", ctypes.POINTER(DecoderLayer)), ("embed", Linear), ("head", Linear),
                ("embed_scale", c_float), ("residual_scale", c_float), ("logit_scale", c_float)]


class DecodeStep(ctypes.Structure):
    _fields_ = [("positions", c_void_p), ("slots", c_void_p), ("block_tables", c_void_p), ("context_lens", c_void_p),
                ("num_seqs", c_int64), ("max_blocks", c_int64), ("max_context", c_int64), ("store_first", c_int64),
                ("state_slots", c_void_p)]


LORA_MAX_PARTS = 4  # cpu_kernels.h


class LoraMatrix(ctypes.Structure):
    _fields_ = [("a", c_void_p), ("b", c_void_p), ("k", c_int64), ("n", c_int64), ("rank", c_int64),
                ("parts", c_int64), ("slots", c_int64), ("part_ends", c_int64 * LORA_MAX_PARTS),
                ("dtype", c_int64), ("a_scale", c_void_p), ("b_scale", c_void_p)]


LORA_DTYPES = {"float32": 0, "bfloat16": 1, "int8": 2}  # LoraMatrix.dtype (cpu_kernels.h LORA_F32, LORA_BF16, LORA_I8)


class LoraStep(ctypes.Structure):
    _fields_ = [("mats", ctypes.POINTER(LoraMatrix)), ("row_slots", c_void_p), ("width", c_int64)]


ABI_VERSION = 23  # cpu_kernels.h, NANOVLLM_ABI_VERSION
STRUCTS = (Linear, MoeExperts, DeltaNetLayer, ShortConvLayer, Mamba2Layer, DecoderLayer, DecoderModel, DecodeStep, LoraMatrix, LoraStep)


def check_abi(lib: ctypes.CDLL, structs: tuple[type[ctypes.Structure], ...] = STRUCTS) -> None:
    """RuntimeError unless the library speaks this module's ABI: its version, and the size, the
    fields and every field's offset of each structure both sides lay out."""
    lib.nanovllm_abi_version.restype = c_int64
    for name in ("nanovllm_struct_size", "nanovllm_field_count"):
        getattr(lib, name).restype, getattr(lib, name).argtypes = c_int64, [ctypes.c_char_p]
    lib.nanovllm_field_offset.restype = c_int64
    lib.nanovllm_field_offset.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    version = lib.nanovllm_abi_version()
    if version != ABI_VERSION:
        raise RuntimeError(f"the C library has ABI version {version}, this module expects {ABI_VERSION}")
    for struct in structs:
        size = lib.nanovllm_struct_size(struct.__name__.encode())
        if size != ctypes.sizeof(struct):
            raise RuntimeError(f"struct {struct.__name__} is {size} bytes in C, {ctypes.sizeof(struct)} in ctypes")
        count = lib.nanovllm_field_count(struct.__name__.encode())
        if count != len(struct._fields_):
            raise RuntimeError(f"struct {struct.__name__} has {count} fields in C's table, {len(struct._fields_)} in ctypes")
        for field, *_ in struct._fields_:
            offset = lib.nanovllm_field_offset(struct.__name__.encode(), field.encode())
            if offset != getattr(struct, field).offset:
                raise RuntimeError(f"{struct.__name__}.{field} is at byte {offset} in C (-1: no such field), "
                                   f"{getattr(struct, field).offset} in ctypes")
