/* Paged decode attention on the CPU.
 *
 * paged_decode_attention_f32: decode attention over the paged KV cache, one query token per sequence.
 *
 * The torch path gathers every sequence's blocks into a padded copy and then runs SDPA over the
 * copy; this kernel reads each cached K and V row once, in place, through the block table.
 * Work items are sequences (or, for small batches, a sequence's KV heads split in kv_heads_per_item
 * chunks), spread over OpenMP threads. Within an item, tokens go outermost, 8 at a time within a
 * block: a cached token's row for all of the item's KV heads is contiguous, while one head's rows
 * sit a page apart (reading head by head was 2-3x slower); the 8 rows are read from memory once
 * (prefetched ahead) and from L1 by every query head sharing them (GQA), and each head's 8 scores
 * come out as one vector (reduce8), the output rows are loaded and stored once per 8 tokens.
 *
 * Layouts (row-major, contiguous):
 *   q            [num_seqs, num_heads, head_dim]
 *   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables [num_seqs, max_blocks] (int32; entries past a sequence's length are not read)
 *   context_lens [num_seqs] (int32, each <= max_context)
 *   out          [num_seqs, num_heads, head_dim]
 * Returns 0, or 1 when a thread could not allocate its score buffer (out is then incomplete).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "cpu_kernels.h"

/* The 8 sums of a[0..8), one per lane (lane i: the sum of a[i]'s lanes). */
#if defined(__AVX2__) && VL == 8
static inline vf reduce8(const vf a[8]) {
    const __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
    const __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]), t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    /* u0: the sums of a[0..4)'s low halves in its low 128 bits, of their high halves in its high
     * 128 bits; u1 the same of a[4..8). */
    return (vf)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#else
static inline vf reduce8(const vf a[8]) {
    vf s;
    for (int i = 0; i < VL; i++) s[i] = hsum(a[i]);
    return s;
}
#endif

/* Cached rows of an item are prefetched this many tokens ahead of their use: an item's rows are a
 * short stream (~100 tokens at the benchmark's contexts) that the hardware prefetcher alone picks
 * up late (docs/performance.md, "Figures from the C kernels' comments"). */
#define PREFETCH_TOKENS 16

/* Prefetch the item's part (`floats` from `first`) of rows [t, t + 8) of a block of n_t tokens. */
static inline void prefetch_rows(const float *first, int64_t stride, int64_t t, int64_t n_t, int64_t floats) {
    const int64_t end = t + 8 < n_t ? t + 8 : n_t;
    for (; t < end; t++)
        for (int64_t f = 0; f < floats; f += 16) __builtin_prefetch(first + t * stride + f, 0, 3);
}

/* Rows [0, PREFETCH_TOKENS) of a block, before its first chunk. */
static inline void prefetch_block_start(const float *first, int64_t stride, int64_t n_t, int64_t floats) {
    for (int64_t t = 0; t < PREFETCH_TOKENS; t += 8) prefetch_rows(first, stride, t, n_t, floats);
}

/* q . k for one row of n. */
static inline float dot_row(const float *q, const float *k, int64_t n) {
    vf a0 = {0}, a1 = {0};
    int64_t d = 0;
    for (; d + 2 * VL <= n; d += 2 * VL) {
        a0 += load_f32(q + d) * load_f32(k + d);
        a1 += load_f32(q + d + VL) * load_f32(k + d + VL);
    }
    for (; d + VL <= n; d += VL) a0 += load_f32(q + d) * load_f32(k + d);
    float s = hsum(a0 + a1);
    for (; d < n; d++) s += q[d] * k[d];
    return s;
}

/* out[i] = q . k_i for the 8 rows k_i = k + i * stride, each of n. */
_Static_assert(VL == 8, "dot_8rows stores its 8 dot products as one vector");
static inline void dot_8rows(const float *q, const float *k, int64_t stride, int64_t n, float *out) {
    vf a[8];
    for (int i = 0; i < 8; i++) a[i] = (vf){0};
    int64_t d = 0;
    for (; d + VL <= n; d += VL) {
        const vf qv = load_f32(q + d);
        for (int i = 0; i < 8; i++) a[i] += qv * load_f32(k + i * stride + d);
    }
    vf s = reduce8(a);
    for (; d < n; d++)
        for (int i = 0; i < 8; i++) s[i] += q[d] * k[i * stride + d];
    store_f32(out, s);
}

void attend_item(const float *q, const float *k_cache, const float *v_cache, const int32_t *table, int64_t len,
                 float *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                 int64_t kv_first, int64_t kv_end, float scale, float *scores, int64_t scores_stride,
                 float *inv_sum) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim; /* floats between consecutive cached tokens */
    const int64_t num_item_heads = (kv_end - kv_first) * group;
    const int64_t item_floats = (kv_end - kv_first) * head_dim; /* the item's part of a cached row */
    /* This item's query heads are consecutive: kv_first * group .. kv_end * group. */
    const float *q_item = q + kv_first * group * head_dim;
    float *out_item = out + kv_first * group * head_dim;

    /* Pass 1: raw scores q . k of every cached token and head of the item, a block at a time
     * (its tokens' rows are consecutive), 8 tokens at a time: their K rows are read once from
     * memory and then from L1 for every head, and their 8 dot products come out as one vector. */
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t n_t = len - t0 < block_size ? len - t0 : block_size;
        const float *k_block = k_cache + (int64_t)table[t0 / block_size] * block_size * token_stride;
        const float *k_first = k_block + kv_first * head_dim;
        prefetch_block_start(k_first, token_stride, n_t, item_floats);
        int64_t t = 0;
        for (; t + 8 <= n_t; t += 8) {
            prefetch_rows(k_first, token_stride, t + PREFETCH_TOKENS, n_t, item_floats);
            for (int64_t h = 0; h < num_item_heads; h++)
                dot_8rows(q_item + h * head_dim, k_block + t * token_stride + (kv_first + h / group) * head_dim,
                          token_stride, head_dim, scores + h * scores_stride + t0 + t);
        }
        for (; t < n_t; t++)
            for (int64_t h = 0; h < num_item_heads; h++)
                scores[h * scores_stride + t0 + t] = dot_row(q_item + h * head_dim,
                                                             k_block + t * token_stride + (kv_first + h / group) * head_dim,
                                                             head_dim);
    }
    /* Softmax numerators per head, exp(scale * (s - max)) (scale > 0, so the max of the raw scores
     * is the max of the scaled ones); the division comes at the end. */
    for (int64_t h = 0; h < num_item_heads; h++) {
        float *row = scores + h * scores_stride;
        float m = -INFINITY;
        for (int64_t t = 0; t < len; t++) m = row[t] > m ? row[t] : m;
        vf sum = {0};
        int64_t t = 0;
        for (; t + VL <= len; t += VL) {
            const vf e = vexp((load_f32(row + t) - m) * scale);
            store_f32(row + t, e);
            sum += e;
        }
        float s = hsum(sum);
        for (; t < len; t++) {
            row[t] = sexp((row[t] - m) * scale);
            s += row[t];
        }
        inv_sum[h] = 1.0f / s;
        memset(out_item + h * head_dim, 0, sizeof(float) * (size_t)head_dim);
    }
    /* Pass 2: out = sum_t p_t v_t, a block and 8 tokens at a time: each head's output vector is
     * loaded once per 8 tokens, their V rows come from memory once for all of the item's heads. */
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t n_t = len - t0 < block_size ? len - t0 : block_size;
        const float *v_block = v_cache + (int64_t)table[t0 / block_size] * block_size * token_stride;
        const float *v_first = v_block + kv_first * head_dim;
        prefetch_block_start(v_first, token_stride, n_t, item_floats);
        for (int64_t t = 0; t < n_t; t += 8) {
            const int64_t nt = n_t - t < 8 ? n_t - t : 8;
            prefetch_rows(v_first, token_stride, t + PREFETCH_TOKENS, n_t, item_floats);
            for (int64_t h = 0; h < num_item_heads; h++) {
                const float *v = v_block + t * token_stride + (kv_first + h / group) * head_dim;
                const float *p = scores + h * scores_stride + t0 + t;
                float *o = out_item + h * head_dim;
                int64_t d = 0;
                for (; d + VL <= head_dim; d += VL) {
                    vf acc = load_f32(o + d);
                    for (int64_t i = 0; i < nt; i++) acc += p[i] * load_f32(v + i * token_stride + d);
                    store_f32(o + d, acc);
                }
                for (; d < head_dim; d++)
                    for (int64_t i = 0; i < nt; i++) o[d] += p[i] * v[i * token_stride + d];
            }
        }
    }
    for (int64_t h = 0; h < num_item_heads; h++) {
        float *o = out_item + h * head_dim;
        for (int64_t d = 0; d < head_dim; d++) o[d] *= inv_sum[h];
    }
}

int paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, const int32_t *context_lens, float *out,
                               int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, int64_t max_blocks,
                               int64_t max_context, float scale, int64_t kv_heads_per_item,
                               int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t items_per_seq = (num_kv_heads + kv_heads_per_item - 1) / kv_heads_per_item;
    const int64_t heads_per_item = kv_heads_per_item * group;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(heads_per_item * max_context));
        float *inv_sum = malloc(sizeof(float) * (size_t)heads_per_item);
        if (scores == NULL || inv_sum == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * items_per_seq; item++) {
            if (scores == NULL || inv_sum == NULL) continue;
            const int64_t s = item / items_per_seq;
            const int64_t kv_first = (item % items_per_seq) * kv_heads_per_item;
            const int64_t kv_end = kv_first + kv_heads_per_item < num_kv_heads ? kv_first + kv_heads_per_item
                                                                               : num_kv_heads;
            attend_item(q + s * num_heads * head_dim, k_cache, v_cache, block_tables + s * max_blocks,
                        context_lens[s], out + s * num_heads * head_dim, num_heads, num_kv_heads, head_dim,
                        block_size, kv_first, kv_end, scale, scores, max_context, inv_sum);
        }
        free(scores);
        free(inv_sum);
    }
    return failed;
}
