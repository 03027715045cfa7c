"""Triton attention over the paged KV cache: decode (one query per sequence, optional split-K) and
variable-length causal prefill whose keys may start in the cache. Called by the triton backend.

Both kernels keep fp32 running max / sum / accumulator (online softmax in base 2) and read the
cache through the block table row by row, so any block size works and no K/V is gathered in Python.
The cache holds the activations' dtype or an fp8 format (store_kvcache.py); attention sees the values
as stored, so prefill rounds its fresh keys and values to the fp8 grid as well, and a token's
attention does not depend on whether its prompt came whole, in chunks or from the prefix cache.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention_tuning import choose_num_splits, decode_tiles, is_hopper, prefill_tiles
from nanovllm.kernels.store_kvcache import FP8_FORMATS, fp8_constants, fp8_round

_LOG2E = 1.4426950408889634


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Fold one tile of base-2 scores s [M, N] (masked with -inf) and values v [N, D] into the state."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet adds nothing
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _capped(s, cap, HAS_SOFTCAP: tl.constexpr):
    """Gemma 2's soft-capping of base-2 scores: cap * tanh(s / cap), cap = softcap * log2(e)
    (tanh through the sigmoid: the interpreter has no libdevice)."""
    if HAS_SOFTCAP:
        s = cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)
    return s


@triton.jit
def _cached(x, KV_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Cache rows as loaded -> the dots' dtype. fp8 goes through fp32 (exact either way; the
    interpreter's direct e5m2 -> fp16 cast flushes subnormals)."""
    if KV_FP8:
        x = x.to(tl.float32)
    return x.to(DOT_DTYPE)


@triton.jit
def _paged_kv_offsets(table_ptr, pos, mask_n, offs_d, kv_head, stride_b, stride_s, stride_h,
                      BLOCK_SIZE: tl.constexpr):
    """Element offsets [N, D] of cache rows at token positions pos, looked up in the block table."""
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    row = block * stride_b + (pos % BLOCK_SIZE) * stride_s + kv_head * stride_h
    return row[:, None] + offs_d[None, :]


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                   out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, sinks_ptr, qk_scale, num_heads, window, softcap,
                   stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_os, stride_oh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
                   KV_FP8: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr):
    # One program: all GROUP query heads sharing one KV head, over one split of one sequence's context.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(context_lens_ptr + seq)
    # A sliding window (window > 0) sees the last `window` keys: the tiles start at its first one.
    start = tl.where(window > 0, tl.maximum(ctx_len - window, 0), 0)
    # The split range comes from the device-side length, so a fixed NUM_SPLITS is graph-safe.
    first_tile = start // BLOCK_N
    num_tiles = tl.cdiv(ctx_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    mask_gd = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_gd, other=0.0)
    q = q.to(DOT_DTYPE)  # a no-op except in the interpreter (see _dot_options)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_ptr = block_tables_ptr + seq * stride_bt
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + offs_n
        mask_n = (pos < ctx_len) & (pos >= start)
        offs = _paged_kv_offsets(table_ptr, pos, mask_n, offs_d, kv_head, stride_kb, stride_ks, stride_kh,
                                 BLOCK_SIZE)
        mask_nd = mask_n[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = _cached(tl.load(k_cache_ptr + offs, mask=mask_nd, other=0.0), KV_FP8, DOT_DTYPE)  # [BLOCK_N, BLOCK_D]
        v = _cached(tl.load(v_cache_ptr + offs, mask=mask_nd, other=0.0), KV_FP8, DOT_DTYPE)
        s = _capped(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale, softcap, HAS_SOFTCAP)  # [G, N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, PRECISION)

    if NUM_SPLITS == 1:
        if HAS_SINKS:  # each head's sink logit joins the denominator only
            sink = tl.load(sinks_ptr + heads, mask=offs_g < GROUP, other=0.0).to(tl.float32) * 1.4426950408889634
            l_i += tl.exp2(sink - m_i)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_offs = seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask_gd)
    else:
        # Partials: [num_seqs, num_heads, NUM_SPLITS(, HEAD_DIM)], unnormalised, fp32.
        rows = (seq * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask_gd)
        tl.store(part_m_ptr + rows, m_i, mask=offs_g < GROUP)
        tl.store(part_l_ptr + rows, l_i, mask=offs_g < GROUP)


@triton.jit
def _decode_reduce_kernel(part_acc_ptr, part_m_ptr, part_l_ptr, sinks_ptr, out_ptr, num_heads, stride_os, stride_oh,
                          HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Merge the split-K partials of one (sequence, head) into the final output row."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    rows = (seq * num_heads + head) * NUM_SPLITS + offs_s
    m = tl.load(part_m_ptr + rows, mask=mask_s, other=float("-inf"))
    l = tl.load(part_l_ptr + rows, mask=mask_s, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # an empty context: every split empty
    w = tl.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
    mask_sd = mask_s[:, None] & (offs_d < HEAD_DIM)[None, :]
    acc = tl.load(part_acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_sd, other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l * w, 0)
    if HAS_SINKS:
        den += tl.exp2(tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634 - m_max)
    out = num / tl.where(den == 0.0, 1.0, den)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_q_ptr, cu_k_ptr,
                    out_ptr, sinks_ptr, qk_scale, window, softcap, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_cb, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    HAS_PREFIX: tl.constexpr, DIAG_SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                    DOT_DTYPE: tl.constexpr, KV_FP8: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr,
                    LIMIT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr):
    # One program: BLOCK_M new tokens of one sequence, one query head. Keys are the cached prefix
    # (paged, all visible) followed by this step's new tokens (packed k/v, causal); with a sliding
    # window (window > 0) a query sees only the last `window` keys up to itself, and the key tiles
    # before the tile's first window are not visited.
    tile_m = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest causal tiles start first
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if tile_m * BLOCK_M >= q_len:
        return
    kv_head = head // GROUP
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # index among the sequence's new tokens
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    mask_md = (offs_m < q_len)[:, None] & mask_d[None, :]
    tokens_m = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tokens_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=mask_md,
                other=0.0).to(DOT_DTYPE)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    if HAS_PREFIX:
        k_len = tl.load(cu_k_ptr + seq + 1) - tl.load(cu_k_ptr + seq)
        prefix_len = k_len - q_len
        table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
        first_key = tl.where(window > 0, tl.maximum(prefix_len + tile_m * BLOCK_M - window + 1, 0), 0)
        for start_n in range(first_key // BLOCK_N * BLOCK_N, prefix_len, BLOCK_N):
            pos = start_n + offs_n
            mask_n = pos < prefix_len
            offs = _paged_kv_offsets(table_ptr, pos, mask_n, offs_d, kv_head, stride_cb, stride_cs, stride_ch,
                                     BLOCK_SIZE)
            mask_nd = mask_n[:, None] & mask_d[None, :]
            k = _cached(tl.load(k_cache_ptr + offs, mask=mask_nd, other=0.0), KV_FP8, DOT_DTYPE)
            v = _cached(tl.load(v_cache_ptr + offs, mask=mask_nd, other=0.0), KV_FP8, DOT_DTYPE)
            s = _capped(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale, softcap, HAS_SOFTCAP)
            seen = mask_n[None, :] & ((window == 0) | (pos[None, :] > (prefix_len + offs_m)[:, None] - window))
            s = tl.where(seen, s, float("-inf"))
            m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, PRECISION)

    # New tokens: key j is visible to query i iff j <= i. Stage 0 walks the key tiles wholly before
    # this query tile (nothing to mask), stage 1 the diagonal ones; later tiles are never visited.
    # Without DIAG_SPLIT (fp32: two loops of exact fp32 dots spill registers) stage 1 does all.
    diag = tile_m * BLOCK_M if DIAG_SPLIT else 0  # a multiple of BLOCK_N (checked by the launcher)
    first_new = tl.where(window > 0, tl.maximum(tile_m * BLOCK_M - window + 1, 0), 0) // BLOCK_N * BLOCK_N
    for stage in tl.static_range(0 if DIAG_SPLIT else 1, 2):
        lo = tl.minimum(first_new, diag) if stage == 0 else tl.maximum(first_new, diag)
        hi = diag if stage == 0 else tl.minimum((tile_m + 1) * BLOCK_M, q_len)
        for start_n in range(lo, hi, BLOCK_N):
            pos = start_n + offs_n
            mask_n = pos < q_len
            tokens_n = (q_start + pos).to(tl.int64)
            mask_nd = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_ptr + tokens_n[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                        mask=mask_nd, other=0.0)
            v = tl.load(v_ptr + tokens_n[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                        mask=mask_nd, other=0.0)
            if KV_FP8:  # the values the cache holds for these tokens
                k = fp8_round(k.to(tl.float32), MANT, EMIN, LIMIT)
                v = fp8_round(v.to(tl.float32), MANT, EMIN, LIMIT)
            k, v = k.to(DOT_DTYPE), v.to(DOT_DTYPE)
            s = _capped(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale, softcap, HAS_SOFTCAP)
            if stage == 1:
                s = tl.where((pos[None, :] <= offs_m[:, None]) & mask_n[None, :], s, float("-inf"))
            s = tl.where((window == 0) | (pos[None, :] > offs_m[:, None] - window), s, float("-inf"))
            m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, PRECISION)

    if HAS_SINKS:  # the head's sink logit joins the denominator only
        l_i += tl.exp2(tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634 - m_i)
    out = acc / l_i[:, None]  # every row sees at least key 0 of the new tokens, so l_i > 0
    tl.store(out_ptr + tokens_m[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_md)


# ---- launchers ----------------------------------------------------------------------------------
def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _dot_options(q: torch.Tensor) -> dict:
    # fp32 is for exactness (tests, CPU parity): no tf32 truncation in the dots. Off CUDA the
    # kernels run in the interpreter, whose bf16 dot multiplies raw bits, so its dots take fp32.
    upcast = q.dtype == torch.bfloat16 and q.device.type != "cuda"
    return dict(PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                DOT_DTYPE=tl.float32 if upcast else _TL_DTYPES[q.dtype])


def _check_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must share shape and strides, got {tuple(k_cache.shape)} "
                         f"{k_cache.stride()} and {tuple(v_cache.shape)} {v_cache.stride()}")
    if k_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim axis must be contiguous")
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, cache_head_dim = k_cache.shape[2:]
    if head_dim != cache_head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"q has {num_heads} heads of dim {head_dim}; the cache has {num_kv_heads} KV heads "
                         f"of dim {cache_head_dim} (num_heads must be a multiple of num_kv_heads)")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           max_context_len: int = 0, num_splits: int | None = None,
                           block_n: int | None = None, window: int | None = None,
                           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [num_seqs, num_heads, head_dim] (query at position context_len - 1) -> same shape; with a
    window, each query over its sequence's last `window` keys; with softcap, the scaled scores
    capped by softcap * tanh(s / softcap); sinks [num_heads]: a logit per head in the denominator.

    Caches [num_blocks, block_size, num_kv_heads, head_dim]; block_tables [num_seqs, max_blocks] int32;
    context_lens [num_seqs] int32. max_context_len (host int, 0 = unknown) only guides num_splits.
    """
    _check_layout(q, k_cache, v_cache)
    q = q if q.stride(-1) == 1 else q.contiguous()
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    block_d = _block_d(head_dim)
    tile_n, num_warps, num_stages = decode_tiles(block_d, q.dtype)
    block_n = block_n or tile_n
    if num_splits is None:
        seen = max_context_len if window is None else min(max_context_len, window)
        num_splits = choose_num_splits(num_seqs, num_kv_heads, seen, q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_splits > 1:
        part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_m = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused by the single-split variant
    sinks_arg = sinks if sinks is not None else out  # a placeholder pointer without sinks
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_m, part_l, sinks_arg,
        scale * _LOG2E, num_heads, window or 0, (softcap or 1.0) * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d, BLOCK_N=block_n, NUM_SPLITS=num_splits, **_dot_options(q),
        KV_FP8=k_cache.dtype in FP8_FORMATS, HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
        num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_acc, part_m, part_l, sinks_arg, out, num_heads, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(max(2, num_splits)), BLOCK_D=block_d,
            HAS_SINKS=sinks is not None, num_warps=4)
    return out


def paged_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                            max_seqlen_q: int, scale: float, block_tables: torch.Tensor | None = None,
                            block_m: int | None = None, block_n: int | None = None,
                            window: int | None = None, softcap: float | None = None,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed new tokens q [num_tokens, num_heads, head_dim] -> same shape.

    k, v [num_tokens, num_kv_heads, head_dim] are the new tokens' keys/values. Sequence i has
    cu_seqlens_k[i+1] - cu_seqlens_k[i] keys; the ones before its new tokens are read from the
    paged cache through block_tables, which must be given whenever any sequence has such a prefix.
    With an fp8 cache, k and v are rounded as the cache holds them (k_cache's dtype says which).
    window: sliding-window attention, each query over the last `window` keys up to itself.
    softcap: the scaled scores capped by softcap * tanh(s / softcap) (Gemma 2). sinks [num_heads]:
    a logit per head that joins the softmax's denominator only (GPT-OSS).
    """
    has_prefix = block_tables is not None
    kv_fp8, fp8 = k_cache.dtype in FP8_FORMATS, fp8_constants(k_cache.dtype)
    if has_prefix:
        _check_layout(q, k_cache, v_cache)
    if q.shape[1] % k.shape[1] != 0 or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)} do not fit: num_heads "
                         "must be a multiple of num_kv_heads and head_dim must agree")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = cu_seqlens_q.numel() - 1
    group = num_heads // k.shape[1]
    block_d = _block_d(head_dim)
    tile_m, tile_n, num_warps, num_stages = prefill_tiles(block_d, q.dtype, is_hopper(q.device))
    block_m, block_n = block_m or tile_m, block_n or tile_n
    if block_m % block_n != 0:
        raise ValueError(f"block_m must be a multiple of block_n, got {block_m} and {block_n}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    if not has_prefix:  # the cache is not read: any tensor serves as a placeholder pointer
        k_cache = v_cache = k
        block_tables = cu_seqlens_q.view(1, -1)
    cache_strides = k_cache.stride()[:3] if has_prefix else (0, 0, 0)
    grid = (triton.cdiv(max_seqlen_q, block_m), num_heads, num_seqs)
    _prefill_kernel[grid](
        q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_k, out,
        sinks if sinks is not None else out, scale * _LOG2E, window or 0,
        (softcap or 1.0) * _LOG2E, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *cache_strides, block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1] if has_prefix else 16,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, HAS_PREFIX=has_prefix,
        DIAG_SPLIT=q.dtype != torch.float32, **_dot_options(q), KV_FP8=kv_fp8, **fp8,
        HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None, num_warps=num_warps, num_stages=num_stages)
    return out
