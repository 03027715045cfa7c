"""LoRA's batched update in Triton (lora/layers.py; the CUDA platform's choice, LinearKernels.lora_triton):
Punica's BGMV shape, every row gathering its own adapter slot, so rows of many adapters and of the base
model share one launch per matrix, whatever their order:

    shrink:  t[i, :]  = A[slot_i] x_i              A [slots, parts x rank, in]
    expand:  y[i, j] += t[i, part(j) x rank :][:rank] . B^T[slot_i, :, j]    B^T [slots, rank, out]

(the scale folded into B; a row with slot < 0 is the base model's and is left as it is). One program
per (row, BR rank rows) for the shrink, per (row, BN output columns) for the expand; A and B may be
held in bf16 / fp16 (lora_dtype), the sums are fp32. Tested under TRITON_INTERPRET=1 against the torch
formula (tests/kernels/test_triton_lora.py)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, t_ptr, K, PR, BR: tl.constexpr, BK: tl.constexpr):
    row = tl.program_id(0)
    rb = tl.program_id(1)
    slot = tl.load(slots_ptr + row)
    rs = rb * BR + tl.arange(0, BR)
    rmask = rs < PR
    acc = tl.zeros([BR], dtype=tl.float32)
    if slot >= 0:
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            kmask = ks < K
            x = tl.load(x_ptr + row * K + ks, mask=kmask, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + (slot * PR + rs[:, None]) * K + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(t_ptr + row * PR + rs, acc, mask=rmask)


@triton.jit
def _expand_kernel(t_ptr, b_ptr, slots_ptr, part_ptr, y_ptr, N, PR, R: tl.constexpr, BN: tl.constexpr):
    row = tl.program_id(0)
    nb = tl.program_id(1)
    slot = tl.load(slots_ptr + row)
    if slot >= 0:
        ns = nb * BN + tl.arange(0, BN)
        nmask = ns < N
        part = tl.load(part_ptr + ns, mask=nmask, other=0)
        acc = tl.zeros([BN], dtype=tl.float32)
        for r in range(R):
            tr = tl.load(t_ptr + row * PR + part * R + r, mask=nmask, other=0.0)
            b = tl.load(b_ptr + (slot * R + r) * N + ns, mask=nmask, other=0.0).to(tl.float32)
            acc += tr * b
        y = tl.load(y_ptr + row * N + ns, mask=nmask, other=0.0)
        tl.store(y_ptr + row * N + ns, (y.to(tl.float32) + acc).to(y.dtype), mask=nmask)


def column_parts(part_sizes: list[int], device) -> torch.Tensor:
    """[out] int32: the part (q | k | v, gate | up) each output column belongs to."""
    return torch.cat([torch.full((size,), p, dtype=torch.int32) for p, size in enumerate(part_sizes)]).to(device)


def lora_add(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor,
             parts: torch.Tensor) -> torch.Tensor:
    """y [T, out] (contiguous, updated in place and returned) += each row's update from its slot:
    x [T, in], a [slots, parts x rank, in], b [slots, rank, out] (B^T), row_slots [T] (< 0: none),
    parts: column_parts of the layer."""
    rows, k = x.shape
    slots, pr, _ = a.shape
    rank, n = b.shape[1], b.shape[2]
    if not y.is_contiguous() or tuple(y.shape) != (rows, n) or a.shape[2] != k or b.shape[0] != slots:
        raise ValueError(f"lora_add: x {tuple(x.shape)}, y {tuple(y.shape)}, A {tuple(a.shape)}, B^T {tuple(b.shape)}"
                         " do not fit")
    x, slots_i64 = x.contiguous(), row_slots.to(torch.int64).contiguous()
    t = torch.empty(rows, pr, dtype=torch.float32, device=x.device)
    block_r = min(32, triton.next_power_of_2(pr))
    _shrink_kernel[(rows, triton.cdiv(pr, block_r))](x, a, slots_i64, t, k, pr, BR=block_r,
                                                       BK=min(128, triton.next_power_of_2(k)))
    block_n = min(128, triton.next_power_of_2(n))
    _expand_kernel[(rows, triton.cdiv(n, block_n))](t, b, slots_i64, parts, y, n, pr, R=rank, BN=block_n)
    return y
