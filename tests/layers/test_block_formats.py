"""The Python table of block formats (layers/quantization/block_formats.py) against the gguf
package's own (ggml's sizes), and the lists derived from it."""
import pytest

gguf = pytest.importorskip("gguf")

from nanovllm.layers.quantization import block_formats  # noqa: E402


@pytest.mark.parametrize("name", sorted(block_formats.FORMATS))
def test_block_sizes_are_ggmls(name):
    assert block_formats.block_shape(name) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name.upper()]]


def test_derived_lists():
    assert block_formats.ONLINE_FORMATS == ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "mxfp4")
    assert block_formats.CONVERTED_FORMATS == {"q5_k": "q5_1"}
    assert "q5_k" not in block_formats.NATIVE_FORMATS and "q6_k" in block_formats.NATIVE_FORMATS
    assert {"q2_k", "q3_k", "iq4_nl", "iq4_xs", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s",
            "iq1_m"} <= set(block_formats.NATIVE_FORMATS)
    # every format `quantization=` offers has a reference quantizer in gguf.quants (q4_k: ours)
    from gguf import quants
    for name in block_formats.ONLINE_FORMATS:
        assert name == "q4_k" or hasattr(quants, name.upper().replace("_", "_")), name


def test_row_bytes_names_a_partial_block():
    assert block_formats.row_bytes("q4_k", 512, "x") == 288
    with pytest.raises(ValueError, match=r"layer\.w: 100 inputs are not whole q8_0 blocks of 32"):
        block_formats.row_bytes("q8_0", 100, "layer.w")
    with pytest.raises(ValueError, match="unknown tensor format 'tq1_0'"):
        block_formats.block_shape("tq1_0")


def test_the_c_table_agrees():
    """The C weight-format table (kernels/cpu_kernels.h, WEIGHT_FORMATS), read from the library
    itself, has every native format with ggml's sizes, and the interleaved rows beside them."""
    import ctypes

    from nanovllm.kernels import cpu_kernels
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no C kernels on this machine")

    class Row(ctypes.Structure):
        _fields_ = [("name", ctypes.c_char_p), ("block_size", ctypes.c_int64), ("block_bytes", ctypes.c_int64),
                    ("group_rows", ctypes.c_int64), ("linear_rows", ctypes.c_void_p), ("row_to_f32", ctypes.c_void_p)]
    count = ctypes.c_int64.in_dll(kernels.lib, "num_weight_types").value
    rows = {r.name.decode(): r for r in (Row * count).in_dll(kernels.lib, "weight_types")}
    for name in block_formats.NATIVE_FORMATS:
        row = rows[name]
        assert (row.block_size, row.block_bytes, row.group_rows) == (*block_formats.block_shape(name), 1), name
        assert row.linear_rows and row.row_to_f32
    interleaved = {n for n in rows if n.endswith("x8")}
    assert interleaved == {"q8_0x8", "q4_0x8", "q4_1x8", "q5_0x8", "q5_1x8", "q4_kx8", "q6_kx8", "mxfp4x8"}
    for name in interleaved:
        plain = rows[name[:-2]]
        assert (rows[name].block_size, rows[name].block_bytes, rows[name].group_rows) == \
            (plain.block_size, plain.block_bytes, 8)
