"""The state layers' decode steps in Triton. Gated DeltaNet's (layers/gated_deltanet.py; the CUDA platform's choice,
LinearKernels.state_triton): one token of each sequence through the gated delta rule on its
state slot, read once and written once in place:

    S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q

One program per (sequence, value head, BV of the value dimension): its [dk, BV] tile of the state
stays in registers between the read and the write, so the step is one pass over the states (at
Qwen3.5's sizes 64 KB per head). The conv and the L2 norms before it are a few elementwise torch ops
(layers/gated_deltanet.py); prefill runs the chunked form in torch, whose matmuls the GPU takes.
Tested under TRITON_INTERPRET=1 against the torch step (tests/kernels/test_triton_deltanet.py).

Mamba-2's (layers/mamba2.py): the one-token SSD rule on each head's P x N state in one pass, one
program per (sequence, head, rows of the state); the conv and the gated norm stay torch ops."""
import torch
import triton
import triton.language as tl


@triton.jit
def _deltanet_step_kernel(state_ptr, slots_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
                          H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    slot = tl.load(slots_ptr + b)
    ks = tl.arange(0, BK)
    vs = vb * BV + tl.arange(0, BV)
    kmask, vmask = ks < DK, vs < DV
    row = b * H + h
    q = tl.load(q_ptr + row * DK + ks, mask=kmask, other=0.0)
    k = tl.load(k_ptr + row * DK + ks, mask=kmask, other=0.0)
    v = tl.load(v_ptr + row * DV + vs, mask=vmask, other=0.0)
    decay = tl.exp(tl.load(g_ptr + row))
    beta = tl.load(beta_ptr + row)
    ptrs = state_ptr + (slot * H + h) * DK * DV + ks[:, None] * DV + vs[None, :]
    mask = kmask[:, None] & vmask[None, :]
    s = tl.load(ptrs, mask=mask, other=0.0) * decay
    delta = beta * (v - tl.sum(s * k[:, None], axis=0))
    s = s + k[:, None] * delta[None, :]
    tl.store(ptrs, s, mask=mask)
    tl.store(o_ptr + row * DV + vs, tl.sum(s * q[:, None], axis=0), mask=vmask)


def deltanet_decode_step(state: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """state [slots, H, dk, dv] fp32 (rows slots[b] updated in place); q, k [B, H, dk] (normalised,
    q scaled), v [B, H, dv], g, beta [B, H]. Returns o [B, H, dv] fp32."""
    num_seqs, heads, dk = q.shape
    dv = v.shape[-1]
    if state.dtype != torch.float32 or not state.is_contiguous() or tuple(state.shape[1:]) != (heads, dk, dv):
        raise ValueError(f"the state is {state.dtype} {tuple(state.shape)}; fp32 [slots, {heads}, {dk}, {dv}] expected")
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    slots = slots.to(torch.int64).contiguous()
    out = torch.empty(num_seqs, heads, dv, dtype=torch.float32, device=q.device)
    block_k, block_v = triton.next_power_of_2(dk), min(32, triton.next_power_of_2(dv))
    grid = (num_seqs, heads, triton.cdiv(dv, block_v))
    _deltanet_step_kernel[grid](state, slots, q, k, v, g, beta, out, H=heads, DK=dk, DV=dv, BK=block_k, BV=block_v)
    return out


@triton.jit
def _ssd_step_kernel(state_ptr, slots_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, y_ptr,
                     H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    slot = tl.load(slots_ptr + b)
    ps = pb * BP + tl.arange(0, BP)
    ns = tl.arange(0, BN)
    pmask, nmask = ps < P, ns < N
    row = b * H + h
    x = tl.load(x_ptr + row * P + ps, mask=pmask, other=0.0)
    dt = tl.load(dt_ptr + row)
    decay = tl.exp(dt * tl.load(a_ptr + h))
    bv = tl.load(b_ptr + row * N + ns, mask=nmask, other=0.0)
    cv = tl.load(c_ptr + row * N + ns, mask=nmask, other=0.0)
    ptrs = state_ptr + (slot * H + h) * P * N + ps[:, None] * N + ns[None, :]
    mask = pmask[:, None] & nmask[None, :]
    s = tl.load(ptrs, mask=mask, other=0.0) * decay + (dt * x)[:, None] * bv[None, :]
    tl.store(ptrs, s, mask=mask)
    y = tl.sum(s * cv[None, :], axis=1) + tl.load(d_ptr + h) * x
    tl.store(y_ptr + row * P + ps, y, mask=pmask)


def mamba2_decode_step(state: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                       B: torch.Tensor, C: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """Mamba-2's one-token rule (layers/mamba2.py ssd_step, plus D x): state [slots, H, P, N] fp32
    (rows slots[b] updated in place); x [B, H, P], dt [B, H] (after softplus), A, D [H], B, C
    [B, H, N] (each head's group). One program per (sequence, head, BP rows of its state). Returns
    y [B, H, P] fp32."""
    num_seqs, heads, p = x.shape
    n = B.shape[-1]
    if state.dtype != torch.float32 or not state.is_contiguous() or tuple(state.shape[1:]) != (heads, p, n):
        raise ValueError(f"the state is {state.dtype} {tuple(state.shape)}; fp32 [slots, {heads}, {p}, {n}] expected")
    x, dt, A, B, C, D = (t.float().contiguous() for t in (x, dt, A, B, C, D))
    slots = slots.to(torch.int64).contiguous()
    out = torch.empty(num_seqs, heads, p, dtype=torch.float32, device=x.device)
    block_p, block_n = min(32, triton.next_power_of_2(p)), triton.next_power_of_2(n)
    _ssd_step_kernel[(num_seqs, heads, triton.cdiv(p, block_p))](state, slots, x, dt, A, B, C, D, out, H=heads, P=p,
                                                                 N=n, BP=block_p, BN=block_n)
    return out
