"""The C kernels of the GGUF block formats (kernels/cpu_quant.c) against independent references:
the `gguf` package's numpy dequantizers for the weights, a numpy int64 sum for the integer part,
and a numpy quantization of the inputs (max |x| / 127 per group, round half to even).
Run in-process with this machine's build, and in subprocesses with the AVX2 + FMA build
(NANOVLLM_CPU_MARCH=x86-64-v3) and the plain C one (x86-64)."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from helpers import qtype, random_weights  # noqa: E402
from nanovllm.kernels import cpu_kernels  # noqa: E402
from nanovllm.layers.quantization.base import CWeightView  # noqa: E402

TYPES = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q6_k", "mxfp4", "f16"]
# Multiplied through a decoded block (kernels/cpu_quant_decoded.h); the i-quants' grids from gguf.quants.
DECODED = ["q2_k", "q3_k", "q5_k", "iq4_nl", "iq4_xs", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m"]


def dequantized(name, raw, k):
    return gguf.quants.dequantize(raw, qtype(name)).reshape(raw.shape[0], k).astype(np.float64)


def input_group(name):
    return 32 if name in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4", "iq4_nl") else 256


XMAX = 127 * 127


def quantized_inputs(x, group, top=XMAX):
    """x as the kernels quantize it: per group d = max|x| / top, X = round(x / d) (half to even);
    top 127^2 for the two planes, 127 for one (input_planes=1, llama.cpp's int8 inputs)."""
    g = x.reshape(x.shape[0], -1, group).astype(np.float32)
    amax = np.abs(g).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(top) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(g * inv), -top, top)
    return (q * (amax / np.float32(top))).reshape(x.shape).astype(np.float64)


def loud_groups(x, group):
    """The groups input_planes=0 rounds to 14 bits: int8's rounding noise, group (max|x| / 127)^2 / 12,
    above 1e-4 of the group's sum of squares (40 dB)."""
    g = x.reshape(x.shape[0], -1, group).astype(np.float64)
    return (np.abs(g).max(-1) / 127) ** 2 * group / 12 > 1e-4 * (g * g).sum(-1)


def per_group_inputs(x, group):
    """x as input_planes=0 rounds it: 14 bits in the loud groups, int8 in the others."""
    loud = np.repeat(loud_groups(x, group), group, axis=1)
    return np.where(loud, quantized_inputs(x, group), quantized_inputs(x, group, top=127))


def with_outliers(rng, rows, k, group):
    """Gaussian inputs where about half the groups hold an outlier (30x the group's largest value)."""
    x = rng.standard_normal((rows, k)).astype(np.float32)
    for r, g in zip(*np.nonzero(rng.random((rows, k // group)) < 0.5)):
        x[r, g * group + rng.integers(group)] = 30 * np.abs(x[r, g * group:(g + 1) * group]).max()
    return x


def exact_inputs(rng, rows, k, group, step=1):
    """Integer inputs, multiples of step, whose every group holds a +-127^2 (the input scale is
    then 1; step 127 for one plane, whose int8 values are then exact)."""
    x = step * rng.integers(-2, 3, size=(rows, k)).astype(np.float32)
    x[:, ::group] = XMAX * rng.choice([-1, 1], size=(rows, k // group))
    return x


def c_linear(kernels, name, raw, k, x, chain=None, bias=None, input_planes=2):
    n = raw.shape[0]
    view = CWeightView(name, torch.from_numpy(raw), n, k, raw.shape[1], next=chain, input_planes=input_planes)
    return cpu_kernels.linear(kernels, cpu_kernels.linear_struct(kernels, view), torch.from_numpy(x),
                              bias).numpy().astype(np.float64)


def check_input_rounding_matches_the_reference(kernels):
    """The build's input quantization (the AVX2 body where the CPU has it) gives the plain C
    reference's integers, scales and flags exactly, for every group size and rounding mode, on rows
    with outlier channels, zeros and ties."""
    rng = np.random.default_rng(3)
    for k, group in ((512, 32), (512, 256), (96, 32)):
        rows = [rng.standard_normal(k).astype(np.float32), np.zeros(k, np.float32),
                (rng.integers(-3, 4, k) * 0.5).astype(np.float32)]  # exact halves: ties after scaling
        spiky = rng.standard_normal(k).astype(np.float32)
        spiky[::37] *= 60.0  # outlier channels: loud groups take two planes under "auto"
        rows.append(spiky)
        for x in rows:
            for mode in (0, 1, 2):
                assert kernels.quantize_row_matches_reference(x.ctypes.data, k, group, mode) == 1, (k, group, mode)


def check_decoded(kernels):
    """The decoded-block formats: rows read back are gguf.quants' dequantization bit for bit; products
    with the inputs rounded to 14 bits, to int8 (input_planes=1) and per group (0), at every row count
    of a pass, and chained after another format."""
    rng = np.random.default_rng(5)
    for name in DECODED:
        group, k = input_group(name), 512
        raw = random_weights(name, 37, k, rng)
        w = dequantized(name, raw, k)
        table = cpu_kernels.linear_struct(kernels, CWeightView(name, torch.from_numpy(raw), 37, k, raw.shape[1]))
        np.testing.assert_array_equal(cpu_kernels.rows_to_f32(kernels, table, torch.arange(37)).numpy(),
                                      w.astype(np.float32), err_msg=name)
        for rows in (1, 2, 3, 4, 7, 21):
            x = with_outliers(rng, rows, k, group)
            for planes, xin in ((2, quantized_inputs(x, group)), (1, quantized_inputs(x, group, top=127)),
                                (0, per_group_inputs(x, group))):
                got = c_linear(kernels, name, raw, k, x, input_planes=planes)
                want = xin @ w.T
                np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max(),
                                           err_msg=f"{name} rows={rows} planes={planes}")
        other = random_weights("q8_0" if group == 32 else "q4_k", 8, k, rng)
        view = CWeightView(name, torch.from_numpy(raw), 37, k, raw.shape[1], input_planes=2)
        x = rng.standard_normal((3, k)).astype(np.float32)
        got = c_linear(kernels, "q8_0" if group == 32 else "q4_k", other, k, x, chain=view)
        want = quantized_inputs(x, group) @ np.concatenate([dequantized("q8_0" if group == 32 else "q4_k", other, k), w]).T
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max(), err_msg=f"{name} chained")


def check_read_kernel(kernels):
    """The read-floor kernel (cpu_kernels.c, read_bytes) reads every byte: its result is the xor of
    all the buffer's 64-bit words, and one flipped bit anywhere changes it."""
    rng = np.random.default_rng(7)
    buf = rng.integers(0, 2**63, size=(3 << 20) // 8, dtype=np.uint64)
    assert kernels.read_bytes(buf.ctypes.data, buf.nbytes) == np.bitwise_xor.reduce(buf).astype(np.int64)
    for at in (0, len(buf) // 2 + 3, len(buf) - 1):
        flipped = buf.copy()
        flipped[at] ^= 1 << 40
        assert kernels.read_bytes(flipped.ctypes.data, flipped.nbytes) != kernels.read_bytes(buf.ctypes.data, buf.nbytes)


def check_all(kernels):
    check_input_rounding_matches_the_reference(kernels)
    check_read_kernel(kernels)
    check_decoded(kernels)
    rng = np.random.default_rng(0)
    for name in TYPES:
        k = 512 if name != "f16" else 200
        for rows in (1, 2, 3, 4, 7, 13, 21):  # from 16 rows the threads quantize their shares into one buffer
            raw = random_weights(name, 37, k, rng)
            x = rng.standard_normal((rows, k)).astype(np.float32)
            got = c_linear(kernels, name, raw, k, x)
            xin = x.astype(np.float64) if name == "f16" else quantized_inputs(x, input_group(name))
            want = xin @ dequantized(name, raw, k).T
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max(), err_msg=f"{name} rows={rows}")
            # the quantization of the inputs (14 bits a value) costs about 1e-4 of the fp32 result
            exact = x.astype(np.float64) @ dequantized(name, raw, k).T
            assert np.abs(got - exact).max() <= 1e-3 * np.abs(exact).max(), name
        if name == "f16":
            continue
        # The integer part, exactly: unit scales and inputs whose every group holds a +-127^2, so
        # the input scale is 1 and every product an integer (k small enough that the sums stay below
        # 2^24, where fp32 holds every integer).
        k = 256 if input_group(name) == 256 else 128
        raw = random_weights(name, 16, k, rng, unit_scales=True)
        x = exact_inputs(rng, 5, k, input_group(name))
        want = x.astype(np.int64) @ np.rint(dequantized(name, raw, k)).astype(np.int64).T
        assert np.abs(want).max() < 2**24
        np.testing.assert_array_equal(c_linear(kernels, name, raw, k, x), want.astype(np.float64), err_msg=name)
        # The embedding's row lookup is the dequantization itself.
        table = cpu_kernels.linear_struct(kernels, CWeightView(name, torch.from_numpy(raw), 16, k, raw.shape[1]))
        rows = cpu_kernels.rows_to_f32(kernels, table, torch.tensor([3, 0, 15, 3])).numpy()
        np.testing.assert_allclose(rows, dequantized(name, raw, k)[[3, 0, 15, 3]], rtol=1e-6, atol=0, err_msg=name)
    # The 8-row interleaved layouts: the same products, and the same rows read back.
    for name in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q6_k", "mxfp4"):
        group = input_group(name)
        k = 512 if group == 256 else 256
        raw = random_weights(name, 40, k, rng)
        x8_name, x8 = cpu_kernels.interleaved(kernels, name, torch.from_numpy(raw), k)
        raw_x8 = x8.numpy()
        assert x8_name == f"{name}x8" and x8.shape == raw.shape and not torch.equal(x8, torch.from_numpy(raw))
        for rows in (1, 3, 6, 18):  # single 8-row groups below X16_MIN_ROWS (8), pairs of them from it
            x = rng.standard_normal((rows, k)).astype(np.float32)
            got = c_linear(kernels, x8_name, x8.numpy(), k, x)
            want = quantized_inputs(x, group) @ dequantized(name, raw, k).T
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max(), err_msg=x8_name)
        k = 256 if group == 256 else 128
        unit = random_weights(name, 16, k, rng, unit_scales=True)
        x = exact_inputs(rng, 5, k, group)
        x8_name, x8 = cpu_kernels.interleaved(kernels, name, torch.from_numpy(unit), k)
        exact = x.astype(np.int64) @ np.rint(dequantized(name, unit, k)).astype(np.int64).T
        assert np.abs(exact).max() < 2**24
        np.testing.assert_array_equal(c_linear(kernels, x8_name, x8.numpy(), k, x), exact.astype(np.float64),
                                      err_msg=x8_name)
        table = cpu_kernels.linear_struct(kernels, CWeightView(x8_name, x8, 16, k, unit.shape[1]))
        rows = cpu_kernels.rows_to_f32(kernels, table, torch.tensor([9, 0, 15])).numpy()
        np.testing.assert_array_equal(rows, dequantized(name, unit, k)[[9, 0, 15]].astype(np.float32))
        # input_planes=1: the inputs rounded to int8 per group (max|x| / 127), the low plane's
        # products skipped; the same for the plain layout's rows (which multiply both planes)
        k = 512 if group == 256 else 256
        x = rng.standard_normal((5, k)).astype(np.float32)
        want = quantized_inputs(x, group, top=127) @ dequantized(name, raw, k).T
        for held, data in ((x8_name, raw_x8), (name, raw)):
            got = c_linear(kernels, held, data, k, x, input_planes=1)
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max(), err_msg=f"{held} 1 plane")
        two = c_linear(kernels, x8_name, raw_x8, k, x)
        assert np.abs(two - want).max() > 10 * np.abs(got - want).max()  # not the two planes' rounding
        k = 256 if group == 256 else 128
        x = exact_inputs(rng, 5, k, group, step=127)
        exact = x.astype(np.int64) @ np.rint(dequantized(name, unit, k)).astype(np.int64).T
        assert np.abs(exact).max() < 2**24
        x8_name, x8 = cpu_kernels.interleaved(kernels, name, torch.from_numpy(unit), k)
        np.testing.assert_array_equal(c_linear(kernels, x8_name, x8.numpy(), k, x, input_planes=1),
                                      exact.astype(np.float64), err_msg=f"{x8_name} 1 plane")
        # input_planes=0 (the default): each group rounded to int8 or to 14 bits as it needs, the
        # interleaved kernels taking the low plane's products of the loud groups only (33 blocks of
        # 32: the 32-weight tile reads the groups' flags 32 at a time, then the one left)
        k = 512 if group == 256 else 32 * 33
        raw = random_weights(name, 40, k, rng)
        raw_x8 = cpu_kernels.interleaved(kernels, name, torch.from_numpy(raw), k)[1].numpy()
        x = with_outliers(rng, 17, k, group)
        loud = loud_groups(x, group)
        assert 0.2 < loud.mean() < 0.8
        w = dequantized(name, raw, k)
        want = per_group_inputs(x, group) @ w.T
        for held, data in ((x8_name, raw_x8), (name, raw)):
            got = c_linear(kernels, held, data, k, x, input_planes=0)
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max(), err_msg=f"{held} per group")
            err = np.abs(got - want).max()
            for other in (quantized_inputs(x, group), quantized_inputs(x, group, top=127)):  # 14 bits, int8 throughout
                assert np.abs(other @ w.T - want).max() > 10 * err, held
    assert cpu_kernels.interleaved(kernels, "e4m3", torch.zeros(8, 36, dtype=torch.uint8), 32) is None
    assert cpu_kernels.interleaved(kernels, "q8_0", torch.zeros(12, 34, dtype=torch.uint8), 32) is None  # 12 rows
    # A chain of parts in different formats (Q4_K q / k, Q6_K v) writes them side by side, bias included.
    k = 256
    q, v = random_weights("q4_k", 12, k, rng), random_weights("q6_k", 5, k, rng)
    x = rng.standard_normal((3, k)).astype(np.float32)
    bias = torch.randn(17)
    v_view = CWeightView("q6_k", torch.from_numpy(v), 5, k, v.shape[1], input_planes=2)
    got = c_linear(kernels, "q4_k", q, k, x, chain=v_view, bias=bias)
    xin = quantized_inputs(x, 256)
    want = np.concatenate([xin @ dequantized("q4_k", q, k).T, xin @ dequantized("q6_k", v, k).T], 1) + bias.numpy()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-4)
    # Dense fp32 / bf16 rows: the weight-row tiles (one weight row wide at 1-2 input rows, TILE_W
    # at 3-4, WIDE_W from 5 in passes of PASS_ROWS, every pass size from 1 to 8; below one panel of
    # inputs: 16 rows with AVX2, 32 with AVX-512) and the outer-product path (from one panel: a last
    # group of weight rows that does not fill, a last panel that does not fill, two blocks of inputs
    # past 256 rows), a k that is not whole vectors.
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(37, 203).to(dtype)
        bias = torch.randn(37)
        for rows in (*range(1, 18), 31, 32, 33, 70, 140, 300):
            x = torch.randn(rows, 203)
            view = CWeightView({torch.float32: "f32", torch.bfloat16: "bf16"}[dtype], w, 37, 203, 203 * w.element_size())
            got = cpu_kernels.linear(kernels, cpu_kernels.linear_struct(kernels, view, bias), x, bias)
            want = x.double() @ w.double().T + bias.double()
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-4, err_msg=f"{dtype} rows={rows}")
        # and the rows as embedding lookups read them: exactly the table's values, k not whole vectors
        view = CWeightView({torch.float32: "f32", torch.bfloat16: "bf16"}[dtype], w, 37, 203, 203 * w.element_size())
        ids = torch.tensor([36, 0, 17])
        assert torch.equal(cpu_kernels.rows_to_f32(kernels, cpu_kernels.linear_struct(kernels, view), ids), w[ids].float())


def test_formats_against_references(kernels):
    check_all(kernels)


def test_bad_layouts_refused(kernels):
    raw = np.zeros((4, 34 * 2), np.uint8)
    with pytest.raises(ValueError, match="byte layout"):  # 64 weights of Q8_0 are 68 bytes a row, not 60
        cpu_kernels.linear_struct(kernels, CWeightView("q8_0", torch.from_numpy(raw[:, :60].copy()), 4, 64, 60))
    with pytest.raises(ValueError, match="no weight type"):
        cpu_kernels.linear_struct(kernels, CWeightView("tq1_0", torch.from_numpy(raw), 4, 64, 68))
    table = cpu_kernels.linear_struct(kernels, CWeightView("q8_0", torch.from_numpy(raw), 4, 64, 68))
    with pytest.raises(ValueError, match="outside"):
        cpu_kernels.rows_to_f32(kernels, table, torch.tensor([4]))


@pytest.mark.parametrize("march,simd", [("x86-64-v3", 1), ("x86-64", 0)])
def test_other_builds(other_build_cache, march, simd):
    """The AVX2 + FMA build (what AVX2-only machines run) and the plain C one, same checks."""
    if os.uname().machine != "x86_64":
        pytest.skip("x86 builds")
    code = ("import sys; sys.path[:0] = ['tests', 'tests/kernels']; from nanovllm.kernels import cpu_kernels; import test_cpu_quant as t; "
            "k = cpu_kernels.load(); assert k is not None; print('simd', k.quant_simd()); t.check_all(k)")
    env = {**os.environ, "NANOVLLM_CPU_MARCH": march, "NANOVLLM_CACHE": str(other_build_cache)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"simd {simd}" in out.stdout


def test_mxfp4_decodes_as_gguf_quants(kernels):
    """Every E8M0 exponent (0 and 1 subnormal, 255 the largest) with every E2M1 code, plain and
    interleaved by 8 rows: the rows the kernels read back are gguf.quants' dequantization bit for bit."""
    blocks = np.zeros((256, 2, 17), np.uint8)  # row e: exponent e, codes 0..15 then 15..0 in both blocks
    blocks[:, :, 0] = np.arange(256)[:, None]
    codes = np.arange(16, dtype=np.uint8)
    blocks[:, :, 1:] = codes | (codes[::-1] << 4)
    raw = blocks.reshape(256, 34)
    with np.errstate(over="ignore"):  # 12 x 2^127 is past fp32 for both
        want = gguf.quants.dequantize(raw, qtype("mxfp4")).reshape(256, 64)
    assert want[0, 1] == 0.5 * 2.0 ** -127 and want[200, 7] == 6 * 2.0 ** 73  # 2^(e - 127) E2M1 and np.isinf(want[255, 7])
    ids = torch.arange(256)
    plain = cpu_kernels.linear_struct(kernels, CWeightView("mxfp4", torch.from_numpy(raw), 256, 64, 34))
    np.testing.assert_array_equal(cpu_kernels.rows_to_f32(kernels, plain, ids).numpy(), want)
    x8_name, x8 = cpu_kernels.interleaved(kernels, "mxfp4", torch.from_numpy(raw), 64)
    table = cpu_kernels.linear_struct(kernels, CWeightView(x8_name, x8, 256, 64, 34))
    np.testing.assert_array_equal(cpu_kernels.rows_to_f32(kernels, table, ids).numpy(), want)
    # and a product through the exponents' vector decode (every scale, the subnormal ones included)
    x = np.zeros((1, 64), np.float32)
    x[0, 7] = 1.0  # picks code 7 (6.0) of each row's first block (exponents 32..199: the product's
    # scales, 2^(e - 128) / 127^2, stay normal fp32 numbers)
    for held, data in (("mxfp4", torch.from_numpy(raw)), (x8_name, x8)):
        got = c_linear(kernels, held, data.numpy()[:200], 64, x)[0]
        np.testing.assert_array_equal(got[32:], want[32:200, 7].astype(np.float64), err_msg=held)
