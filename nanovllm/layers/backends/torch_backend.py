"""Pure-PyTorch attention over the paged KV cache: the CPU path and the reference for the others.
Its metadata keeps the host-side lengths its per-sequence loops and length groups need."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanovllm.kernels import cpu_kernels
from nanovllm.layers.backends.base import AttentionBackend, AttentionBatch
from nanovllm.layers.backends.kv_formats import KVFormat


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int, fmt: KVFormat,
              dtype: torch.dtype) -> torch.Tensor:
    """The first num_tokens cached rows of one sequence as values: [num_tokens, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (num_tokens + block_size - 1) // block_size
    # index_select copies whole blocks; advanced indexing builds an index per element (docs/performance.md, "KV gather by blocks").
    rows = select_blocks(cache, block_table[:num_blocks])  # [num_blocks, block_size, num_kv_heads, row]
    return stored_values(rows.flatten(0, 1)[:num_tokens], fmt, dtype)


def copyable(t: torch.Tensor) -> torch.Tensor:
    """t, or its bytes where torch has no copy kernels for its dtype (float8)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def select_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    return copyable(cache).index_select(0, blocks).view(cache.dtype)


def stored_values(rows: torch.Tensor, fmt: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows as values in dtype (the rows themselves where the cache holds dtype)."""
    return rows if rows.dtype == dtype else fmt.dequantize(rows, dtype)


def causal_mask(q_len: int, k_len: int, device, window: int | None = None) -> torch.Tensor:
    """[q_len, k_len] bool: query i (at position k_len - q_len + i) sees keys 0..its position, or
    with a window only the last `window` of them."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device).unsqueeze(1)
    k_pos = torch.arange(k_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    return mask if window is None else mask & (k_pos > q_pos - window)


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
                   softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """q [B, H, Lq, D], k/v [B, Hkv, Lk, D], mask broadcastable to [B, H, Lq, Lk] (True: seen) ->
    [B, H, Lq, D], with what SDPA has no step for: the scaled scores capped by softcap * tanh(s /
    softcap) (Gemma 2), and sinks [H], a logit per head in the softmax's denominator only (GPT-OSS)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # one more column, dropped after the softmax
        column = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
         is_causal: bool, softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [Lq, H, D], k/v [Lk, Hkv, D] -> [Lq, H, D], grouped-query aware.
    NOTE: 4-D inputs (a batch of one): with 3-D ones torch takes its unfused math path on CPU
    (docs/performance.md, "SDPA with 4-D inputs")."""
    if softcap is not None or sinks is not None:
        if is_causal:
            mask = causal_mask(q.shape[0], k.shape[0], q.device)
        out = math_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                             v.transpose(0, 1).unsqueeze(0), scale, mask, softcap, sinks)
        return out.squeeze(0).transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(0).transpose(0, 1)


# Queries per SDPA call over a cached prefix (a chunked prefill's later chunks): SDPA's is_causal
# aligns the triangle top-left, so these calls take an explicit mask, and a chunk's [q_len, k_len]
# one (a float copy inside SDPA) cost 2+ GB and a quarter of the speed at 16384 x 32768 tokens
# (docs/performance.md, "Prefill attention"); per block of rows it is [rows, keys up to the block's last query].
PREFIX_QUERY_BLOCK = 1024


def causal_over_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [Lq, H, D]: the queries at the last Lq of k / v's Lk positions, each seeing the keys up to its
    own -> [Lq, H, D], PREFIX_QUERY_BLOCK rows at a time."""
    q_len, k_len = q.shape[0], k.shape[0]
    out = torch.empty_like(q)
    for r0 in range(0, q_len, PREFIX_QUERY_BLOCK):
        r1 = min(q_len, r0 + PREFIX_QUERY_BLOCK)
        keys = k_len - q_len + r1  # up to the block's last query
        mask = causal_mask(r1 - r0, keys, q.device)
        out[r0:r1] = sdpa(q[r0:r1], k[:keys], v[:keys], scale, mask, False, softcap, sinks)
    return out


@dataclass
class TorchMetadata:
    """Prefill: seqlens_q / seqlens_k (new tokens, whole key range) per sequence; block_tables only
    when some sequence has a cached prefix. Decode: block_tables [num_seqs, max_blocks] (-1 padded),
    context_lens [num_seqs] and its host copy seqlens_k (None under CUDA graphs: nothing host-side
    may change between replays), max_seqlen_k the longest context."""

    seqlens_q: list[int] | None = None
    seqlens_k: list[int] | None = None
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    max_seqlen_k: int = 0
    rows_share_tables: bool = False  # decode rows of one sequence (AttentionBatch.rows_share_tables)
    # Filled by the first layer of a CPU decode step and reused by the others.
    decode_groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None


class TorchBackend(AttentionBackend):
    """Caches in any KV format. Prefill and decode both see the keys and values as stored, so a
    token gets the same attention whether its prompt came in one prefill, in chunks or from the
    prefix cache."""

    name = "torch"
    auto_devices = ("cpu", "cuda")

    def __init__(self, device: str = "cpu", kv_format: KVFormat | None = None):
        super().__init__(device, kv_format)
        # The C attention kernels and KV store on CPU, when they build; None keeps the torch path.
        self.cpu_kernel = cpu_kernels.load() if device == "cpu" else None

    @classmethod
    def kv_format_error(cls, kv_format: KVFormat, dtype: torch.dtype) -> str | None:
        return None

    def stores_values(self, dtype: torch.dtype) -> bool:
        """Whether the cache holds activations of dtype as they are (no rounding on store)."""
        return self.kv_format.storage == dtype

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        if self.stores_values(k.dtype):
            return super().store_kvcache(k, v, k_cache, v_cache, slot_mapping)
        if self.cpu_kernel is not None and k.dtype == torch.float32:
            return cpu_kernels.store_kv(self.cpu_kernel, k, v, k_cache, v_cache, self.kv_format.c_type, slot_mapping)
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        shape = (-1, *k_cache.shape[-2:])
        copyable(k_cache).view(shape).index_copy_(0, slots, copyable(self.kv_format.quantize(k[keep])))
        copyable(v_cache).view(shape).index_copy_(0, slots, copyable(self.kv_format.quantize(v[keep])))

    def prefill_in_c(self) -> bool:
        """Whether prefill over this cache is the C int8 kernel (which reads every key from the cache,
        so its metadata always carries the block tables)."""
        return self.cpu_kernel is not None and self.kv_format.blocked

    def prepare(self, batch: AttentionBatch) -> TorchMetadata:
        if batch.is_prefill:
            tables = batch.block_table_tensor() if batch.has_cached_prefix or self.prefill_in_c() else None
            return TorchMetadata(seqlens_q=batch.num_new_tokens, seqlens_k=batch.context_lens, block_tables=tables,
                                 max_seqlen_k=max(batch.context_lens))
        return TorchMetadata(seqlens_k=batch.context_lens, block_tables=batch.block_table_tensor(),
                             context_lens=batch.context_lens_tensor(), max_seqlen_k=max(batch.context_lens),
                             rows_share_tables=batch.rows_share_tables)

    def decode_metadata(self, block_tables, context_lens, max_seqlen_k: int) -> TorchMetadata:
        return TorchMetadata(block_tables=block_tables, context_lens=context_lens, max_seqlen_k=max_seqlen_k)

    def decode_tensors(self, metadata: TorchMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return metadata.block_tables, metadata.context_lens

    def prefill(self, q, k, v, k_cache, v_cache, metadata: TorchMetadata, scale: float,
                window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Each sequence's new tokens over its keys as the cache holds them: the fresh K/V where
        nothing is cached before them (rounded to the cache's format first, which gives the values
        stored), else its blocks gathered; the queries as the format's decode takes them (round_query).
        torch's SDPA (flash attention on CPU) either way: it ran 2-3x faster than a C kernel reading the
        paged cache in place in fp32 (docs/performance.md, "Prefill attention"). Over an int8 cache (and no window,
        softcap or sinks) the C kernel with integer Q K^T does it instead (cpu_prefill_attention.c). A window narrower than the keys makes
        the mask explicit (and the keys before the first query's window are left out)."""
        has_cache = k_cache.numel() > 0
        if (has_cache and self.prefill_in_c() and window is None and softcap is None and sinks is None
                and q.dtype == torch.float32 and metadata.block_tables is not None):
            return cpu_kernels.paged_prefill_attention_q8(self.cpu_kernel, q, k_cache, v_cache, metadata.block_tables,
                                                          metadata.seqlens_q, metadata.seqlens_k, scale)
        rounded = has_cache and not self.stores_values(q.dtype)
        q = self.kv_format.round_query(q) if has_cache else q  # int8: as decode multiplies it
        out = torch.empty_like(q)
        q_start = 0
        for i, (q_len, k_len) in enumerate(zip(metadata.seqlens_q, metadata.seqlens_k)):
            qi = q[q_start: q_start + q_len]
            if k_len == q_len or not has_cache:  # no cached prefix: the fresh K/V
                ki, vi = k[q_start: q_start + q_len], v[q_start: q_start + q_len]
                if rounded:
                    ki, vi = (self.kv_format.dequantize(self.kv_format.quantize(x), q.dtype) for x in (ki, vi))
            else:
                table = metadata.block_tables[i]
                ki = gather_kv(k_cache, table, k_len, self.kv_format, q.dtype)
                vi = gather_kv(v_cache, table, k_len, self.kv_format, q.dtype)
            first = 0 if window is None else max(0, k_len - q_len - window + 1)  # the first key any query sees
            if window is not None and first + window < k_len:
                mask = causal_mask(q_len, k_len, q.device, window)[:, first:]
                oi = sdpa(qi, ki[first:], vi[first:], scale, mask, False, softcap, sinks)
            elif k_len == q_len or not has_cache:
                oi = sdpa(qi, ki, vi, scale, None, q_len > 1, softcap, sinks)
            else:
                oi = causal_over_prefix(qi, ki[first:], vi[first:], scale, softcap, sinks)
            out[q_start: q_start + q_len] = oi
            q_start += q_len
        return out

    def decode(self, q, k_cache, v_cache, metadata: TorchMetadata, scale: float,
               window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        # q: [num_seqs, num_heads, head_dim]; one query per sequence at position context_len - 1.
        if self.device == "cpu" and metadata.seqlens_k is not None:
            if self.cpu_kernel is not None and q.dtype == torch.float32:
                return cpu_kernels.paged_decode_attention(
                    self.cpu_kernel, q, k_cache, v_cache, self.kv_format.c_type, metadata.block_tables,
                    metadata.context_lens, metadata.max_seqlen_k, scale, window, softcap, sinks)
            return self.decode_grouped(self.kv_format.round_query(q), k_cache, v_cache, metadata, scale, window,
                                       softcap, sinks)
        return decode_padded(self.kv_format.round_query(q), k_cache, v_cache, metadata.block_tables,
                             metadata.context_lens, scale, self.kv_format, window, softcap, sinks)

    def decode_grouped(self, q, k_cache, v_cache, metadata: TorchMetadata, scale: float,
                       window: int | None = None, softcap: float | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
        """CPU decode in groups of sequences of similar length, each padded only to its own
        longest context: padding every sequence to the batch's longest one made attention 2.5x
        slower at batch 64 with contexts of 64..512 (docs/performance.md, "Decode attention grouped by length")."""
        if metadata.decode_groups is None:
            metadata.decode_groups = length_groups(metadata.seqlens_k, metadata.block_tables,
                                                   metadata.context_lens, k_cache.shape[1])
        out = torch.empty_like(q)
        for rows, tables, lens in metadata.decode_groups:
            out[rows] = decode_padded(q.index_select(0, rows), k_cache, v_cache, tables, lens, scale, self.kv_format,
                                      window, softcap, sinks)
        return out


DECODE_GROUP_SIZE = 8  # sequences per group: more groups pad less but call SDPA more often


def length_groups(context_lens: list[int], block_tables: torch.Tensor, lens: torch.Tensor, block_size: int,
                  group_size: int = DECODE_GROUP_SIZE) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(row indices, block tables cut to the group's longest context, context lengths) per group of
    sequences sorted by context length."""
    order = sorted(range(len(context_lens)), key=context_lens.__getitem__)
    groups = []
    for start in range(0, len(order), group_size):
        members = order[start: start + group_size]
        rows = torch.tensor(members)
        num_blocks = -(-context_lens[members[-1]] // block_size)  # the group's longest context
        groups.append((rows, block_tables.index_select(0, rows)[:, :num_blocks], lens.index_select(0, rows)))
    return groups


def decode_padded(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, scale: float, fmt: KVFormat, window: int | None = None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Every sequence's K/V gathered (as values) and padded to the widest block table, masked past
    its length (and, with a window, before its last `window` keys)."""
    tables = block_tables.clamp(min=0)
    num_seqs, max_blocks = tables.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    flat = tables.flatten()
    k = stored_values(select_blocks(k_cache, flat), fmt, q.dtype).view(num_seqs, max_blocks * block_size,
                                                                       num_kv_heads, -1)
    v = stored_values(select_blocks(v_cache, flat), fmt, q.dtype).view(num_seqs, max_blocks * block_size,
                                                                       num_kv_heads, -1)
    positions = torch.arange(max_blocks * block_size, device=q.device)
    mask = positions.unsqueeze(0) < context_lens.unsqueeze(1)
    if window is not None:
        mask &= positions.unsqueeze(0) >= context_lens.unsqueeze(1) - window
    mask = mask[:, None, None, :]
    if softcap is not None or sinks is not None:
        return math_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), scale, mask, softcap,
                              sinks).squeeze(2)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != num_kv_heads)  # [num_seqs, num_heads, 1, head_dim]
    return out.squeeze(2)
