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

TYPES = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q6_k", "f16"]


def dequantized(name, raw, k):
    return gguf.quants.dequantize(raw, qtype(name)).reshape(raw.shape[0], k).astype(np.float64)


def input_group(name):
    return 256 if name.endswith("_k") else 32


def quantized_inputs(x, group):
    """x as the kernels quantize it: per group d = max|x| / 127, q = round(x / d) (half to even)."""
    g = x.reshape(x.shape[0], -1, group).astype(np.float32)
    amax = np.abs(g).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(g * inv), -127, 127)
    return (q * (amax / np.float32(127))).reshape(x.shape).astype(np.float64)


def c_linear(kernels, name, raw, k, x, chain=None, bias=None):
    n = raw.shape[0]
    view = CWeightView(name, torch.from_numpy(raw), n, k, raw.shape[1], next=chain)
    return cpu_kernels.linear(kernels, cpu_kernels.linear_struct(kernels, view), torch.from_numpy(x),
                              bias).numpy().astype(np.float64)


def check_all(kernels):
    rng = np.random.default_rng(0)
    for name in TYPES:
        k = 512 if name != "f16" else 200
        for rows in (1, 2, 3, 4, 7, 13):
            raw = random_weights(name, 37, k, rng)
            x = rng.standard_normal((rows, k)).astype(np.float32)
            got = c_linear(kernels, name, raw, k, x)
            xin = x.astype(np.float64) if name == "f16" else quantized_inputs(x, input_group(name))
            want = xin @ dequantized(name, raw, k).T
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max(), err_msg=f"{name} rows={rows}")
            # the quantization of the inputs costs about 1% of the fp32 result, not more
            exact = x.astype(np.float64) @ dequantized(name, raw, k).T
            assert np.abs(got - exact).max() <= 0.03 * np.abs(exact).max(), name
        if name == "f16":
            continue
        # The integer part, exactly: unit scales and inputs whose every group holds a +-127, so the
        # input scale is 1 and every product an integer.
        raw = random_weights(name, 16, 512, rng, unit_scales=True)
        x = rng.integers(-6, 7, size=(5, 512)).astype(np.float32)
        x[:, ::input_group(name)] = 127 * rng.choice([-1, 1], size=(5, 512 // input_group(name)))
        want = x.astype(np.int64) @ np.rint(dequantized(name, raw, 512)).astype(np.int64).T
        np.testing.assert_array_equal(c_linear(kernels, name, raw, 512, x), want.astype(np.float64), err_msg=name)
        # The embedding's row lookup is the dequantization itself.
        table = cpu_kernels.linear_struct(kernels, CWeightView(name, torch.from_numpy(raw), 16, 512, raw.shape[1]))
        rows = cpu_kernels.rows_to_f32(kernels, table, torch.tensor([3, 0, 15, 3])).numpy()
        np.testing.assert_allclose(rows, dequantized(name, raw, 512)[[3, 0, 15, 3]], rtol=1e-6, atol=0, err_msg=name)
    # A chain of parts in different formats (Q4_K q / k, Q6_K v) writes them side by side, bias included.
    k = 256
    q, v = random_weights("q4_k", 12, k, rng), random_weights("q6_k", 5, k, rng)
    x = rng.standard_normal((3, k)).astype(np.float32)
    bias = torch.randn(17)
    v_view = CWeightView("q6_k", torch.from_numpy(v), 5, k, v.shape[1])
    got = c_linear(kernels, "q4_k", q, k, x, chain=v_view, bias=bias)
    xin = quantized_inputs(x, 256)
    want = np.concatenate([xin @ dequantized("q4_k", q, k).T, xin @ dequantized("q6_k", v, k).T], 1) + bias.numpy()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-4)


@pytest.fixture(scope="module")
def kernels():
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no C compiler")
    return kernels


def test_formats_against_references(kernels):
    check_all(kernels)


def test_bad_layouts_refused(kernels):
    raw = np.zeros((4, 34 * 2), np.uint8)
    with pytest.raises(ValueError, match="byte layout"):  # 64 weights of Q8_0 are 68 bytes a row, not 60
        cpu_kernels.linear_struct(kernels, CWeightView("q8_0", torch.from_numpy(raw[:, :60].copy()), 4, 64, 60))
    with pytest.raises(ValueError, match="no weight type"):
        cpu_kernels.linear_struct(kernels, CWeightView("q3_k", torch.from_numpy(raw), 4, 64, 68))
    table = cpu_kernels.linear_struct(kernels, CWeightView("q8_0", torch.from_numpy(raw), 4, 64, 68))
    with pytest.raises(ValueError, match="outside"):
        cpu_kernels.rows_to_f32(kernels, table, torch.tensor([4]))


@pytest.mark.parametrize("march,simd", [("x86-64-v3", 1), ("x86-64", 0)])
def test_other_builds(tmp_path, march, simd):
    """The AVX2 + FMA build (what AVX2-only machines run) and the plain C one, same checks."""
    if os.uname().machine != "x86_64":
        pytest.skip("x86 builds")
    code = ("import sys; sys.path.insert(0, 'tests'); from nanovllm.kernels import cpu_kernels; import test_cpu_quant as t; "
            "k = cpu_kernels.load(); assert k is not None; print('simd', k.quant_simd()); t.check_all(k)")
    env = {**os.environ, "NANOVLLM_CPU_MARCH": march, "NANOVLLM_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"simd {simd}" in out.stdout
