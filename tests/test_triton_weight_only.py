"""The Triton weight-only kernel (kernels/triton_weight_only.py) against x @ W^T of the weight its
format defines (weight_only.QuantizedWeight.dequantize, itself checked exactly against each format's
definition in test_prequantized.py), for 4-bit / 8-bit integers with and without zero points, groups
in order and scattered (g_idx), and fp8; under the Triton interpreter on CPU (compiled on CUDA)."""
import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from nanovllm.kernels.triton_weight_only import pack, weight_only_linear  # noqa: E402
from nanovllm.layers.quantization.weight_only import QuantizedWeight  # noqa: E402

CASES = {  # name -> (value range, with zero points, group, scattered groups, fp8)
    "int4-sym-g32": ((-8, 8), False, 32, False, False),
    "int4-zeros-g64-g_idx": ((0, 16), True, 64, True, False),
    "int8-sym-channel": ((-128, 128), False, None, False, False),
    "int8-zeros-g32": ((-128, 128), True, 32, False, False),
    "fp8-g64": (None, False, 64, False, True),
}


def weight(case: str, n: int, k: int, seed: int) -> QuantizedWeight:
    (span, has_zeros, group, scattered, fp8), g = CASES[case], torch.Generator().manual_seed(seed)
    group = group or k
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    g_idx = torch.randperm(k, generator=g) // group if scattered else None
    if fp8:
        values = (torch.randn(n, k, generator=g) * 50).to(torch.float8_e4m3fn)
        return QuantizedWeight(values, scales, group)
    values = torch.randint(*span, (n, k), generator=g, dtype=torch.int32)
    zeros = torch.randint(*span, (n, k // group), generator=g, dtype=torch.int32) if has_zeros else None
    return QuantizedWeight(values, scales, group, zeros, g_idx)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("m", [1, 5, 33])
def test_kernel_equals_the_dequantized_matmul(case, m):
    n, k = 80, 192  # neither a multiple of the 64-output tile, nor k of every group
    qw = weight(case, n, k, seed=m)
    packed = pack(qw.values, qw.scales, qw.group, qw.zeros, qw.g_idx)
    assert packed.bits == (4 if case.startswith("int4") else 8)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7))
    ref = x.double() @ qw.dequantize().double().t()
    for name in ("q", "scales", "zeros", "g_idx"):
        t = getattr(packed, name)
        if t is not None:
            setattr(packed, name, t.to(DEVICE))
    got = weight_only_linear(x.to(DEVICE), packed).cpu().double()
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item()), (got - ref).abs().max()
