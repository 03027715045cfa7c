"""The one table of GGUF tensor formats in Python: a row per format (its name as the C weight-type
table spells it, kernels/cpu_kernels.c weight_types[]; weights and bytes per block; what can make
or multiply it). The lists of formats (what a .gguf file may hold, what `quantization=` offers, what
the Triton kernel unpacks) are read from here; the C side has its own row per format
(docs/architecture.md, "Where to change what")."""
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockFormat:
    name: str            # lower-case GGUF type name ("q4_k")
    block_weights: int   # weights per block (1 for the plain float formats)
    block_bytes: int     # bytes per block
    online: bool = False  # `quantization=` makes it at load (gguf.quants has a reference quantizer)
    triton: bool = False  # the Triton weight-only kernel unpacks it (layers/quantization/gguf_triton.py)
    # A format no kernel multiplies, converted at load into this one (its blocks re-cut exactly,
    # loader/gguf.py); None: held and multiplied as it is.
    converted_to: str | None = None


FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("f32", 1, 4),
    BlockFormat("f16", 1, 2),
    BlockFormat("bf16", 1, 2),
    BlockFormat("q8_0", 32, 34, online=True, triton=True),
    BlockFormat("q4_0", 32, 18, online=True, triton=True),
    BlockFormat("q4_1", 32, 20, online=True, triton=True),
    BlockFormat("q5_0", 32, 22, online=True, triton=True),
    BlockFormat("q5_1", 32, 24, online=True, triton=True),
    BlockFormat("q4_k", 256, 144, online=True, triton=True),
    BlockFormat("q6_k", 256, 210, triton=True),
    # OCP microscaling FP4 (GPT-OSS's experts, GGUF type MXFP4): an E8M0 exponent and 32 E2M1 codes.
    BlockFormat("mxfp4", 32, 17, online=True, triton=True),
    # A Q5_K sub-block of 32 (6-bit scale and min under the super-block's fp16 d and dmin) is a
    # Q5_1 block with d = d sc and m = -dmin mn rounded to fp16.
    BlockFormat("q5_k", 256, 176, converted_to="q5_1"),
    # Multiplied through a decoded block (kernels/cpu_quant_decoded.h; on a GPU gguf_decoded.py): 2-
    # and 3-bit K-quants, the 16-level IQ4s, and the grid i-quants of Unsloth's dynamic files (their
    # grids from gguf.quants).
    BlockFormat("q2_k", 256, 84, triton=True),
    BlockFormat("q3_k", 256, 110, triton=True),
    BlockFormat("iq4_nl", 32, 18, triton=True),
    BlockFormat("iq4_xs", 256, 136, triton=True),
    BlockFormat("iq2_xxs", 256, 66, triton=True),
    BlockFormat("iq2_xs", 256, 74, triton=True),
    BlockFormat("iq2_s", 256, 82, triton=True),
    BlockFormat("iq3_xxs", 256, 98, triton=True),
    BlockFormat("iq3_s", 256, 110, triton=True),
    BlockFormat("iq1_s", 256, 50, triton=True),
    BlockFormat("iq1_m", 256, 56, triton=True),
)}

# The formats a .gguf file may hold as they are; those converted at load; what `quantization=` offers.
NATIVE_FORMATS = tuple(name for name, f in FORMATS.items() if f.converted_to is None)
CONVERTED_FORMATS = {name: f.converted_to for name, f in FORMATS.items() if f.converted_to is not None}
ONLINE_FORMATS = tuple(name for name, f in FORMATS.items() if f.online)
TRITON_FORMATS = tuple(name for name, f in FORMATS.items() if f.triton)


def block_shape(type_name: str) -> tuple[int, int]:
    """(weights, bytes) per block of a format, by its lower-case name."""
    f = FORMATS.get(type_name)
    if f is None:
        raise ValueError(f"unknown tensor format {type_name!r}; known: {', '.join(FORMATS)}")
    return f.block_weights, f.block_bytes


def row_bytes(type_name: str, k: int, what: str) -> int:
    """Bytes of one row of k weights; ValueError naming `what` unless k is whole blocks."""
    size, nbytes = block_shape(type_name)
    if k % size:
        raise ValueError(f"{what}: {k} inputs are not whole {type_name} blocks of {size}")
    return k // size * nbytes
