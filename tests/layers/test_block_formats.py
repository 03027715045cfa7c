"""The Python table of block formats (layers/quantization/block_formats.py) against the gguf
package's own (ggml's sizes), and the lists derived from it."""
import pytest

gguf = pytest.importorskip("gguf")

from nanovllm.layers.quantization import block_formats  # noqa: E402


@pytest.mark.parametrize("name", sorted(block_formats.FORMATS))
def test_block_sizes_are_ggmls(name):
    assert block_formats.block_shape(name) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name.upper()]]


def test_derived_lists():
    assert block_formats.ONLINE_FORMATS == ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k")
    assert block_formats.CONVERTED_FORMATS == {"q5_k": "q5_1"}
    assert "q5_k" not in block_formats.NATIVE_FORMATS and "q6_k" in block_formats.NATIVE_FORMATS
    # every format `quantization=` offers has a reference quantizer in gguf.quants (q4_k: ours)
    from gguf import quants
    for name in block_formats.ONLINE_FORMATS:
        assert name == "q4_k" or hasattr(quants, name.upper().replace("_", "_")), name


def test_row_bytes_names_a_partial_block():
    assert block_formats.row_bytes("q4_k", 512, "x") == 288
    with pytest.raises(ValueError, match=r"layer\.w: 100 inputs are not whole q8_0 blocks of 32"):
        block_formats.row_bytes("q8_0", 100, "layer.w")
    with pytest.raises(ValueError, match="unknown tensor format 'q3_k'"):
        block_formats.block_shape("q3_k")
