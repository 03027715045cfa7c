/* Attention over the paged KV cache on the CPU, in every KV storage format (cpu_kernels.h, KV_*; the
 * formats' reading in cpu_kv_formats.h, their storing in cpu_kv_formats.c).
 *
 * paged_decode_attention: one query token per sequence (attend_item, which the C decode step calls
 *   too). Prefill over int8 caches is cpu_prefill_attention.c (integer multiply-adds); over the other
 *   formats it stays torch's SDPA over the values as stored (layers/backends/torch_backend.py): a
 *   flash-style fp32 C kernel over the paged cache ran 2-3x slower (docs/performance.md, "Prefill attention").
 *
 * Cached rows are converted to fp32 as they are read (8 values at a time, from registers: no fp32
 * copy of the cache is made); scores, softmax and outputs are fp32. The kernel is one function
 * body per format, generated from a body that takes the format as a compile-time constant.
 *
 * Decode: work items are sequences (or, for small batches, a sequence's KV heads split in
 * kv_heads_per_item chunks), spread over OpenMP threads. Within an item, tokens go outermost, 8 at
 * a time within a block: a cached token's row for all of the item's KV heads is contiguous, while
 * one head's rows sit a page apart (reading head by head was 2-3x slower); the 8 rows are read
 * from memory once (prefetched ahead) and from L1 by every query head sharing them (GQA), and each
 * head's 8 scores come out as one vector (reduce8), the output rows are loaded and stored once per
 * 8 tokens. Two passes (scores, then values) over the item's rows: each row is read from memory
 * once per pass.
 *
 * Layouts (row-major, contiguous):
 *   q, out       [num_tokens, num_heads, head_dim] fp32
 *   k/v cache    [num_blocks, block_size, num_kv_heads, kv_row_bytes(type, head_dim)] bytes
 *   block_tables [num_seqs, max_blocks] (int32; entries past a sequence's length are not read)
 *   context_lens [num_seqs] (int32, each <= max_context)
 * Entry points return 0, or 1 when a thread could not allocate its buffers (out is then incomplete).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_kv_formats.h"

/* ---- decode ------------------------------------------------------------------------------------ */
/* The 8 sums of a[0..8), one per lane (lane i: the sum of a[i]'s lanes). */
#if ISA_AVX2 && VL == 8
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

/* Cached rows of an item are prefetched this many tokens ahead of their use, across block boundaries
 * (the block table says where the rows ahead are), and a part at a time between the units of work
 * (a query head's dot products, a KV head's values): the hardware prefetcher follows the 8 rows a
 * chunk reads side by side poorly, and a burst of a whole chunk's lines (100+) stalls the core on
 * its miss buffers. From memory (contexts past the last-level cache) this doubled the rate a core
 * reads the cache at (docs/performance.md, "Decode attention from memory"). */
#define PREFETCH_TOKENS 32

/* The item's part of the rows of (up to) 8 tokens: `bytes` at `first`, one token every `stride`. */
typedef struct {
    const uint8_t *first;
    int64_t stride, lines_per_token, lines;
} Ahead;

/* The rows of the item's tokens [pos, pos + 8) counted from t_first (pos a multiple of 8, so they
 * share a block), those before len; none past it. */
static inline Ahead rows_ahead(const uint8_t *cache, const int32_t *table, int64_t t_first, int64_t pos, int64_t len,
                               int64_t block_size, int64_t token_stride, int64_t offset, int64_t bytes) {
    Ahead a = {NULL, token_stride, (bytes + 63) / 64, 0};
    if (pos >= len) return a;
    const int64_t at = t_first + pos;
    a.first = cache + ((int64_t)table[at / block_size] * block_size + at % block_size) * token_stride + offset;
    a.lines = (len - pos < 8 ? len - pos : 8) * a.lines_per_token;
    return a;
}

/* Prefetch part `part` of `parts` of a's cache lines. */
static inline void prefetch_part(const Ahead *a, int64_t part, int64_t parts) {
    if (a->lines == 0) return;
    const int64_t from = a->lines * part / parts, to = a->lines * (part + 1) / parts;
    int64_t j = from / a->lines_per_token, f = from - j * a->lines_per_token;
    for (int64_t i = from; i < to; i++) {
        __builtin_prefetch(a->first + j * a->stride + 64 * f, 0, 3);
        if (++f == a->lines_per_token) f = 0, j++;
    }
}

/* The first PREFETCH_TOKENS tokens' rows of an item, before its first chunk. */
static inline void prefetch_start(const uint8_t *cache, const int32_t *table, int64_t t_first, int64_t len,
                                  int64_t block_size, int64_t token_stride, int64_t offset, int64_t bytes) {
    for (int64_t pos = 0; pos < PREFETCH_TOKENS; pos += 8) {
        const Ahead a = rows_ahead(cache, table, t_first, pos, len, block_size, token_stride, offset, bytes);
        prefetch_part(&a, 0, 1);
    }
}

/* q . k for one row k of n values. */
static inline __attribute__((always_inline)) float dot_row(const int type, const float *q, const uint8_t *k,
                                                           int64_t n) {
    vf a0 = {0}, a1 = {0};
    int64_t d = 0;
    for (; d + 2 * VL <= n; d += 2 * VL) {
        a0 += load_f32(q + d) * kv_load8(type, k, d);
        a1 += load_f32(q + d + VL) * kv_load8(type, k, d + VL);
    }
    for (; d + VL <= n; d += VL) a0 += load_f32(q + d) * kv_load8(type, k, d);
    float s = hsum(a0 + a1);
    for (; d < n; d++) s += q[d] * kv_load1(type, k, d);
    return s;
}

/* out[i] = q . k_i for the 8 rows k_i = k + i * stride (bytes), each of n values. */
_Static_assert(VL == 8, "dot_8rows stores its 8 dot products as one vector");
static inline __attribute__((always_inline)) void dot_8rows(const int type, const float *q, const uint8_t *k,
                                                            int64_t stride, int64_t n, float *out) {
    vf a[8];
    for (int i = 0; i < 8; i++) a[i] = (vf){0};
    int64_t d = 0;
    if (type == KV_Q8_0) { /* per block of 32: the int8 products summed, then scaled once */
        for (; d < n; d += 32) {
            const vf q0 = load_f32(q + d), q1 = load_f32(q + d + 8), q2 = load_f32(q + d + 16), q3 = load_f32(q + d + 24);
            for (int i = 0; i < 8; i++) {
                const uint8_t *blk = k + i * stride + d / 32 * 34;
                const vf part = q0 * i8x8(blk + 2) + q1 * i8x8(blk + 10) + q2 * i8x8(blk + 18) + q3 * i8x8(blk + 26);
                a[i] += f16x1(blk) * part;
            }
        }
    }
    for (; d + VL <= n; d += VL) {
        const vf qv = load_f32(q + d);
        for (int i = 0; i < 8; i++) a[i] += qv * kv_load8(type, k + i * stride, d);
    }
    vf s = reduce8(a);
    for (; d < n; d++)
        for (int i = 0; i < 8; i++) s[i] += q[d] * kv_load1(type, k + i * stride, d);
    store_f32(out, s);
}

/* ---- grouped query heads, 16- and 32-bit caches ----------------------------------------------------
 * Where G query heads share a KV head (GQA), each cached value is converted to fp32 once, in
 * registers, and multiplied into all G heads' sums: the per-head paths (dot_8rows, and the value loop
 * below) converted it once per query head, 3 instructions per multiply-add where these take 1.5-2.
 * 8 accumulators either way: scores of 8 / G tokens x G heads, or output values of G heads x
 * 8 / G vectors. (The 8-bit formats have their own grouped paths: the integer dot products, and
 * converts_once.) */
static inline int grouped_float(const int type, int64_t group, int64_t head_dim) {
    return (type == KV_F32 || type == KV_F16 || type == KV_BF16) && (group == 2 || group == 4 || group == 8) &&
           head_dim % (8 / group * VL) == 0;
}

/* out[g * out_stride + r] = q_g . k_r for the G query heads q_g = q + g * n and the 8 / G rows
 * k_r = k + r * stride (bytes), n values each (a multiple of VL). */
static inline __attribute__((always_inline)) void dot_group_t(const int type, const int G, const float *q,
                                                              const uint8_t *k, int64_t stride, int64_t n,
                                                              float *out, int64_t out_stride) {
    const int T = 8 / G;
    vf a[8];
    for (int i = 0; i < 8; i++) a[i] = (vf){0};
    for (int64_t d = 0; d < n; d += VL) {
        vf x[8];
        for (int r = 0; r < T; r++) x[r] = kv_load8(type, k + r * stride, d);
        for (int g = 0; g < G; g++) {
            const vf qv = load_f32(q + g * n + d);
            for (int r = 0; r < T; r++) a[g * T + r] += qv * x[r];
        }
    }
    const vf s = reduce8(a);
    for (int g = 0; g < G; g++)
        for (int r = 0; r < T; r++) out[g * out_stride + r] = s[g * T + r];
}

/* o_g[0, head_dim) += sum_i p_g[i] v_i for the G query heads of a KV head (o_g = o + g * head_dim,
 * p_g = p + g * p_stride) over nt rows v_i = v + i * stride, head_dim a multiple of 8 / G vectors. */
static inline __attribute__((always_inline)) void accumulate_group_t(const int type, const int G, const uint8_t *v,
                                                                     int64_t stride, int64_t nt, const float *p,
                                                                     int64_t p_stride, float *o, int64_t head_dim,
                                                                     const Ahead *ahead, int64_t part, int64_t parts) {
    const int C = 8 / G; /* vectors per head per pass over the rows */
    const int64_t steps = head_dim / (C * VL);
    for (int64_t d = 0; d < head_dim; d += C * VL) {
        prefetch_part(ahead, part * steps + d / (C * VL), parts * steps);
        vf acc[8];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < C; c++) acc[g * C + c] = load_f32(o + g * head_dim + d + c * VL);
        for (int64_t i = 0; i < nt; i++) {
            vf x[8];
            for (int c = 0; c < C; c++) x[c] = kv_load8(type, v + i * stride, d + c * VL);
            for (int g = 0; g < G; g++) {
                const float pw = p[g * p_stride + i];
                const vf w = {pw, pw, pw, pw, pw, pw, pw, pw};
                for (int c = 0; c < C; c++) acc[g * C + c] += w * x[c];
            }
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < C; c++) store_f32(o + g * head_dim + d + c * VL, acc[g * C + c]);
    }
}

/* The grouped paths with G a constant: the scores of a KV head's group for 8 rows, and its values. */
static inline __attribute__((always_inline)) void dot_group(const int type, int64_t group, const float *q,
                                                            const uint8_t *k, int64_t stride, int64_t n, float *out,
                                                            int64_t out_stride, const Ahead *ahead, int64_t part,
                                                            int64_t parts) {
    const int64_t T = 8 / group;
    for (int64_t r = 0; r < 8; r += T) {
        prefetch_part(ahead, part * group + r / T, parts * group);
        const uint8_t *kr = k + r * stride;
        switch (group) {
        case 2: dot_group_t(type, 2, q, kr, stride, n, out + r, out_stride); break;
        case 4: dot_group_t(type, 4, q, kr, stride, n, out + r, out_stride); break;
        default: dot_group_t(type, 8, q, kr, stride, n, out + r, out_stride); break;
        }
    }
}

static inline __attribute__((always_inline)) void accumulate_group(const int type, int64_t group, const uint8_t *v,
                                                                   int64_t stride, int64_t nt, const float *p,
                                                                   int64_t p_stride, float *o, int64_t head_dim,
                                                                   const Ahead *ahead, int64_t part, int64_t parts) {
    switch (group) {
    case 2: accumulate_group_t(type, 2, v, stride, nt, p, p_stride, o, head_dim, ahead, part, parts); break;
    case 4: accumulate_group_t(type, 4, v, stride, nt, p, p_stride, o, head_dim, ahead, part, parts); break;
    default: accumulate_group_t(type, 8, v, stride, nt, p, p_stride, o, head_dim, ahead, part, parts); break;
    }
}

/* Rows of a KV head the grouped paths convert once to fp32 are at most this wide. */
#define KV_TILE_DIM 256

/* Whether a KV head's rows are converted to fp32 once for all the query heads of its group: for the
 * fp8 formats, whose conversion costs more than storing and rereading fp32 rows from L1 (measured on
 * q8_0 before it got the integer path below: 3.3 -> 1.5 ms per layer at 8192 tokens); f16 and bf16
 * convert in one or two instructions, and the detour made them slower (docs/performance.md, "A 16-bit KV cache by default"). */
static inline int converts_once(const int type, int64_t group, int64_t head_dim) {
    return (type == KV_E4M3 || type == KV_E5M2) && group > 1 && head_dim <= KV_TILE_DIM;
}

/* tile[i][0, head_dim) = row i (at rows + i * stride bytes) as fp32, i < n. */
static inline __attribute__((always_inline)) void rows_to_f32(const int type, const uint8_t *rows, int64_t stride,
                                                              int64_t n, int64_t head_dim, float *tile) {
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *r = rows + i * stride;
        float *o = tile + i * head_dim;
        int64_t d = 0;
        if (type == KV_Q8_0)
            for (; d < head_dim; d += 32) {
                const vf s = (vf){0} + f16x1(r + d / 32 * 34);
                for (int c = 0; c < 32; c += VL) store_f32(o + d + c, s * i8x8(r + d / 32 * 34 + 2 + c));
            }
        for (; d + VL <= head_dim; d += VL) store_f32(o + d, kv_load8(type, r, d));
        for (; d < head_dim; d++) o[d] = kv_load1(type, r, d);
    }
}

/* o[0, head_dim) += sum_i p[i] tile[i], i < n (fp32 rows). */
static inline void accumulate_rows(const float *tile, int64_t n, int64_t head_dim, const float *p, float *o) {
    int64_t d = 0;
    for (; d + VL <= head_dim; d += VL) {
        vf acc = load_f32(o + d);
        for (int64_t i = 0; i < n; i++) acc += p[i] * load_f32(tile + i * head_dim + d);
        store_f32(o + d, acc);
    }
    for (; d < head_dim; d++)
        for (int64_t i = 0; i < n; i++) o[d] += p[i] * tile[i * head_dim + d];
}

/* ---- q8_0 caches: integer dot products ------------------------------------------------------------
 * As llama.cpp's q8_0 cache does: the query is rounded to 8 bits per block of 32 (here with an fp32
 * scale), and q . k is, per block, the int8 products summed exactly in int32 times the two scales:
 * with AVX2 two instructions per 32 products (|k| unsigned times q with k's sign, then pairs summed)
 * where converting k to fp32 took 12. The rounding is the format's (KVFormat.round_query in
 * layers/backends/kv_formats.py: the torch path and the tests round the query the same way). The
 * values are then summed per KV head for all its query heads at once, in registers. */
/* Query values (heads x head_dim) of one item the integer path holds: 128 heads of 256, every model's
 * whole sequence; past it an item would take the fp32 path with the query unrounded. */
#define Q8_ITEM_VALUES 32768
#define Q8_MAX_GROUP 8 /* query heads per KV head the value pass keeps in registers */

/* x[0, n) (n a multiple of 32) rounded per block b of 32: q = round(x / d[b]) (to nearest even, via
 * x * (1 / d)), d[b] = max|x| / 127 (0 for a block of zeros, whose q are 0). */
static void round_query_q8(const float *x, int64_t n, int8_t *q, float *d) {
    for (int64_t b = 0; b < n / 32; b++) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fabsf(x[b * 32 + j]) > amax ? fabsf(x[b * 32 + j]) : amax;
        const float db = amax / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
        d[b] = db;
        for (int j = 0; j < 32; j++) q[b * 32 + j] = (int8_t)nearbyintf(x[b * 32 + j] * inv);
    }
}

/* 8 partial sums (as fp32, each exact) of the 32 products of a q8_0 block's values k and query values q. */
#if KV_F16C
static inline vf q8_block_dot(const uint8_t *k, const int8_t *q) {
    const __m256i kv = _mm256_loadu_si256((const __m256i *)k), qv = _mm256_loadu_si256((const __m256i *)q);
    /* |k| <= 127 and |q| <= 127: each pair sum fits int16 (2 * 127 * 127) */
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(kv, kv), _mm256_sign_epi8(qv, kv));
    return (vf)_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#else
static inline vf q8_block_dot(const uint8_t *k, const int8_t *q) {
    vf s;
    for (int j = 0; j < VL; j++) {
        int32_t a = 0;
        for (int m = 0; m < 32 / VL; m++) a += (int8_t)k[j * (32 / VL) + m] * q[j * (32 / VL) + m];
        s[j] = (float)a;
    }
    return s;
}
#endif

/* kd[i * nb + b] = the scale of block b of row i = k + i * stride, i < n: converted once per KV head,
 * read by each of its query heads. */
static inline void q8_row_scales(const uint8_t *k, int64_t stride, int64_t nb, int64_t n, float *kd) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t b = 0; b < nb; b++) kd[i * nb + b] = f16x1(k + i * stride + b * 34);
}

/* out[i] = q . k_i for n <= 8 rows k_i = k + i * stride of nb q8_0 blocks (their scales kd), the
 * query in 8 bits (qq, its scales qd). */
static inline void dot_rows_q8(const int8_t *qq, const float *qd, const uint8_t *k, int64_t stride, int64_t nb,
                               int64_t n, const float *kd, float *out) {
    vf a[8];
    for (int i = 0; i < 8; i++) a[i] = (vf){0};
    for (int64_t b = 0; b < nb; b++)
        for (int64_t i = 0; i < n; i++)
            a[i] += q8_block_dot(k + i * stride + b * 34 + 2, qq + b * 32) * (kd[i * nb + b] * qd[b]);
    const vf s = reduce8(a);
    for (int64_t i = 0; i < n; i++) out[i] = s[i];
}

#if KV_F16C
/* With 256-bit vpdpbusd (isa.h, ISA_VNNI256) the int8 scores take dot_8rows_q8_t's second definition. */

/* The 8 rows' scales of each block (block b's in lane i of kdt[b]), rows k + i * stride. */
static inline void q8_block_scales8(const uint8_t *k, int64_t stride, int64_t nb, vf *kdt) {
    for (int64_t b = 0; b < nb; b++) {
        uint16_t h[8];
        for (int i = 0; i < 8; i++) memcpy(&h[i], k + i * stride + b * 34, sizeof h[i]);
        kdt[b] = (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
    }
}

/* The 8 sums of a[0..8)'s int32 lanes, one per lane (reduce8 in integers). */
static inline __m256i reduce8_epi32(const __m256i a[8]) {
    const __m256i t0 = _mm256_hadd_epi32(a[0], a[1]), t1 = _mm256_hadd_epi32(a[2], a[3]);
    const __m256i t2 = _mm256_hadd_epi32(a[4], a[5]), t3 = _mm256_hadd_epi32(a[6], a[7]);
    const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

#if !ISA_VNNI256
/* dot_rows_q8 for a whole chunk of 8 rows, block first: each block's 8 integer dot products reduced
 * to one vector (a lane per row) before anything is converted, so that the conversion and the
 * scales (kdt[b]: the 8 rows' scales of block b) cost one instruction per 8 rows, not one per row
 * (qq, qd: G heads' rounded queries one after
 * another, head_dim values apart; out: head g's 8 scores at out + g * out_stride). */
static inline __attribute__((always_inline)) void dot_8rows_q8_t(const int G, const int8_t *qq, const float *qd,
                                                                 const uint8_t *k, int64_t stride, int64_t nb,
                                                                 const vf *kdt, float *out, int64_t out_stride,
                                                                 const Ahead *ahead, int64_t part, int64_t parts) {
    vf acc[Q8_MAX_GROUP];
    for (int g = 0; g < G; g++) acc[g] = (vf){0};
    for (int64_t b = 0; b < nb; b++) {
        prefetch_part(ahead, part * nb + b, parts * nb);
        for (int g = 0; g < G; g++) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(qq + g * nb * 32 + b * 32));
            __m256i p[8];
            for (int i = 0; i < 8; i++) {
                const __m256i kv = _mm256_loadu_si256((const __m256i *)(k + i * stride + b * 34 + 2));
                p[i] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(kv, kv), _mm256_sign_epi8(qv, kv)),
                                         _mm256_set1_epi16(1));
            }
            const float s = qd[g * nb + b];
            acc[g] += (vf)_mm256_cvtepi32_ps(reduce8_epi32(p)) * (kdt[b] * s);
        }
    }
    for (int g = 0; g < G; g++) store_f32(out + g * out_stride, acc[g]);
}

#else
/* dot_8rows_q8_t with vpdpbusd, which multiplies unsigned bytes by signed ones without saturating:
 * each row's block flipped to k + 128 once for all G heads, then one instruction per row and head
 * (the AVX2 path's two sign flips, pair sums and widening are per row and head); the 128 * sum(q)
 * that the flip adds is taken off by starting each row's sums at -128 * (q's 4-value sums), one
 * vpdpbusd per head and block. */
static inline __attribute__((always_inline)) void dot_8rows_q8_t(const int G, const int8_t *qq, const float *qd,
                                                                 const uint8_t *k, int64_t stride, int64_t nb,
                                                                 const vf *kdt, float *out, int64_t out_stride,
                                                                 const Ahead *ahead, int64_t part, int64_t parts) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), zero = _mm256_setzero_si256();
    vf acc[Q8_MAX_GROUP];
    for (int g = 0; g < G; g++) acc[g] = (vf){0};
    for (int64_t b = 0; b < nb; b++) {
        prefetch_part(ahead, part * nb + b, parts * nb);
        __m256i ku[8];
        for (int i = 0; i < 8; i++)
            ku[i] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(k + i * stride + b * 34 + 2)), flip);
        for (int g = 0; g < G; g++) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(qq + g * nb * 32 + b * 32));
            const __m256i start = _mm256_sub_epi32(zero, dpbusd256(zero, flip, qv));
            __m256i p[8];
            for (int i = 0; i < 8; i++) p[i] = dpbusd256(start, ku[i], qv);
            acc[g] += (vf)_mm256_cvtepi32_ps(reduce8_epi32(p)) * (kdt[b] * qd[g * nb + b]);
        }
    }
    for (int g = 0; g < G; g++) store_f32(out + g * out_stride, acc[g]);
}
#endif
#endif

/* o_g[0, head_dim) += sum_i p_g[i] v_i for the G query heads g of one KV head (o_g = o + g * head_dim,
 * p_g = p + g * p_stride) over n <= 8 q8_0 rows v_i = v + i * stride: each row's values converted
 * once, for all G heads. */
static inline __attribute__((always_inline)) void accumulate_q8_t(const int G, const uint8_t *v, int64_t stride,
                                                                  int64_t n, int64_t nb, const float *p,
                                                                  int64_t p_stride, float *o, int64_t head_dim,
                                                                  const Ahead *ahead, int64_t part, int64_t parts) {
    for (int64_t b = 0; b < nb; b++) {
        prefetch_part(ahead, part * nb + b, parts * nb);
        float w[Q8_MAX_GROUP][8];
        for (int64_t i = 0; i < n; i++) {
            const float dv = f16x1(v + i * stride + b * 34);
            for (int g = 0; g < G; g++) w[g][i] = p[g * p_stride + i] * dv;
        }
        for (int c = 0; c < 32; c += VL) {
            vf acc[Q8_MAX_GROUP];
            for (int g = 0; g < G; g++) acc[g] = load_f32(o + g * head_dim + b * 32 + c);
            for (int64_t i = 0; i < n; i++) {
                const vf x = i8x8(v + i * stride + b * 34 + 2 + c);
                for (int g = 0; g < G; g++) acc[g] += w[g][i] * x;
            }
            for (int g = 0; g < G; g++) store_f32(o + g * head_dim + b * 32 + c, acc[g]);
        }
    }
}

#if KV_F16C && !ISA_AVX512F
/* o_g[0, 32) += sum_i w[g][i] x_i for the 32 values x_i of one block of 8 rows (x_i at v + i * stride,
 * o_g = o + g * head_dim): CH vectors of output per head per pass (G x CH accumulators: 8 registers,
 * the converted rows and a weight beside them, so nothing spills on AVX2's 16), each weight
 * broadcast once per half-block pass. */
static inline __attribute__((always_inline)) void accumulate_block_8rows(const int G, const uint8_t *v, int64_t stride,
                                                                         const float w[Q8_MAX_GROUP][8], float *o,
                                                                         int64_t head_dim) {
    const int CH = G >= 8 ? 1 : G == 4 ? 2 : 4; /* vectors of 8 values per head per pass */
    for (int c0 = 0; c0 < 32; c0 += CH * VL) {
        vf acc[8];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < CH; c++) acc[g * CH + c] = load_f32(o + g * head_dim + c0 + c * VL);
        for (int i = 0; i < 8; i++) {
            vf x[4];
            for (int c = 0; c < CH; c++) x[c] = i8x8(v + i * stride + c0 + c * VL);
            for (int g = 0; g < G; g++) {
                const vf wv = (vf){0} + w[g][i];
                for (int c = 0; c < CH; c++) acc[g * CH + c] += wv * x[c];
            }
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < CH; c++) store_f32(o + g * head_dim + c0 + c * VL, acc[g * CH + c]);
    }
}

#elif KV_F16C
/* The same with 16-lane registers (AVX-512): a row's 32 values are two conversions, and the G heads'
 * 2 G accumulators (16 registers at G = 8) stay in registers for the whole block beside them (of
 * the 32): each row's weight is one broadcast per head, the output one load and store per head. */
static inline __attribute__((always_inline)) void accumulate_block_8rows(const int G, const uint8_t *v, int64_t stride,
                                                                         const float w[Q8_MAX_GROUP][8], float *o,
                                                                         int64_t head_dim) {
    __m512 acc[2 * Q8_MAX_GROUP];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < 2; c++) acc[2 * g + c] = _mm512_loadu_ps(o + g * head_dim + 16 * c);
    for (int i = 0; i < 8; i++) {
        const uint8_t *x8 = v + i * stride;
        const __m512 x0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)x8)));
        const __m512 x1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(x8 + 16))));
        for (int g = 0; g < G; g++) {
            const __m512 wv = _mm512_set1_ps(w[g][i]);
            acc[2 * g] = _mm512_fmadd_ps(wv, x0, acc[2 * g]);
            acc[2 * g + 1] = _mm512_fmadd_ps(wv, x1, acc[2 * g + 1]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < 2; c++) _mm512_storeu_ps(o + g * head_dim + 16 * c, acc[2 * g + c]);
}
#endif

#if KV_F16C
/* accumulate_q8_t for a whole chunk of 8 rows: the rows' weights times their block scales as one
 * vector per head and block, then each block's values by accumulate_block_8rows. */
static inline __attribute__((always_inline)) void accumulate_8rows_q8_t(const int G, const uint8_t *v,
                                                                        int64_t stride, int64_t nb, const float *p,
                                                                        int64_t p_stride, float *o, int64_t head_dim,
                                                                        const Ahead *ahead, int64_t part,
                                                                        int64_t parts) {
    vf dvt[KV_TILE_DIM / 32];
    q8_block_scales8(v, stride, nb, dvt);
    for (int64_t b = 0; b < nb; b++) {
        prefetch_part(ahead, part * nb + b, parts * nb);
        float w[Q8_MAX_GROUP][8];
        for (int g = 0; g < G; g++) store_f32(w[g], load_f32(p + g * p_stride) * dvt[b]);
        accumulate_block_8rows(G, v + b * 34 + 2, stride, (const float(*)[8])w, o + b * 32, head_dim);
    }
}

/* The group sizes the whole-chunk paths take (G a constant). */
static inline int whole_chunks_q8(int64_t group) { return group == 1 || group == 2 || group == 4 || group == 8; }

/* The scores of n rows by dot_8rows_q8_t where they are a whole chunk of a group it takes; 0 (nothing
 * done) otherwise. */
static inline int dot_chunk_q8(int64_t group, const int8_t *qq, const float *qd, const uint8_t *k, int64_t stride,
                               int64_t nb, int64_t n, float *out, int64_t out_stride, const Ahead *ahead, int64_t part,
                               int64_t parts) {
    if (n != 8 || !whole_chunks_q8(group)) return 0;
    vf kdt[KV_TILE_DIM / 32];
    q8_block_scales8(k, stride, nb, kdt);
    switch (group) {
    case 1: dot_8rows_q8_t(1, qq, qd, k, stride, nb, kdt, out, out_stride, ahead, part, parts); break;
    case 2: dot_8rows_q8_t(2, qq, qd, k, stride, nb, kdt, out, out_stride, ahead, part, parts); break;
    case 4: dot_8rows_q8_t(4, qq, qd, k, stride, nb, kdt, out, out_stride, ahead, part, parts); break;
    default: dot_8rows_q8_t(8, qq, qd, k, stride, nb, kdt, out, out_stride, ahead, part, parts); break;
    }
    return 1;
}

/* The values of n rows by accumulate_8rows_q8_t where they are a whole chunk of a group it takes; 0
 * (nothing done) otherwise. */
static inline int accumulate_chunk_q8(int64_t group, const uint8_t *v, int64_t stride, int64_t n, int64_t nb,
                                      const float *p, int64_t p_stride, float *o, int64_t head_dim, const Ahead *ahead,
                                      int64_t part, int64_t parts) {
    if (n != 8 || !whole_chunks_q8(group)) return 0;
    switch (group) {
    case 1: accumulate_8rows_q8_t(1, v, stride, nb, p, p_stride, o, head_dim, ahead, part, parts); break;
    case 2: accumulate_8rows_q8_t(2, v, stride, nb, p, p_stride, o, head_dim, ahead, part, parts); break;
    case 4: accumulate_8rows_q8_t(4, v, stride, nb, p, p_stride, o, head_dim, ahead, part, parts); break;
    default: accumulate_8rows_q8_t(8, v, stride, nb, p, p_stride, o, head_dim, ahead, part, parts); break;
    }
    return 1;
}
#else
/* Without AVX2 + F16C there are no whole-chunk paths: every chunk takes the per-row ones. */
#define dot_chunk_q8(...) 0
#define accumulate_chunk_q8(...) 0
#endif

/* accumulate_q8_t with G a constant for the usual group sizes; other groups a head at a time. */
static inline void accumulate_q8(int64_t group, const uint8_t *v, int64_t stride, int64_t n, int64_t nb,
                                 const float *p, int64_t p_stride, float *o, int64_t head_dim, const Ahead *ahead,
                                 int64_t part, int64_t parts) {
    if (accumulate_chunk_q8(group, v, stride, n, nb, p, p_stride, o, head_dim, ahead, part, parts)) return;
    switch (group) {
    case 1: accumulate_q8_t(1, v, stride, n, nb, p, p_stride, o, head_dim, ahead, part, parts); return;
    case 2: accumulate_q8_t(2, v, stride, n, nb, p, p_stride, o, head_dim, ahead, part, parts); return;
    case 4: accumulate_q8_t(4, v, stride, n, nb, p, p_stride, o, head_dim, ahead, part, parts); return;
    case 8: accumulate_q8_t(8, v, stride, n, nb, p, p_stride, o, head_dim, ahead, part, parts); return;
    default:
        for (int64_t g = 0; g < group; g++)
            accumulate_q8_t(1, v, stride, n, nb, p + g * p_stride, p_stride, o + g * head_dim, head_dim, ahead,
                            part * group + g, parts * group);
    }
}

/* The query heads of KV heads [kv_first, kv_end) of one sequence (q, out: [num_heads, head_dim]) over
 * its cached tokens [t_first, t_end) (t_first a multiple of block_size), the first `skip` of them
 * left out (before a sliding window: read, given no weight); softcap > 0: each scaled score s
 * becomes softcap * tanh(s / softcap) (Gemma 2's logit soft-capping); sinks (NULL: none): a logit
 * per query head that joins the softmax's denominator only (GPT-OSS). part_max == NULL: the item
 * is the whole sequence, and out is the attention. Otherwise out is the item's share before the
 * softmax division (sum_t exp(s_t - m) v_t) with part_max = m and part_sum = sum_t exp(s_t - m) per
 * head, for merge_parts. */
static inline __attribute__((always_inline)) void attend_item_t(
    const int type, const float *q, const uint8_t *k_cache, const uint8_t *v_cache, const int32_t *table,
    int64_t t_first, int64_t t_end, float *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t kv_first, int64_t kv_end, float scale, float *scores, int64_t scores_stride,
    float *inv_sum, float *part_max, float *part_sum, int64_t skip, float softcap, const float *sinks) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = kv_row_bytes(type, head_dim);
    const int64_t token_stride = num_kv_heads * row; /* bytes between consecutive cached tokens */
    const int64_t num_item_heads = (kv_end - kv_first) * group;
    const int64_t item_bytes = (kv_end - kv_first) * row; /* the item's part of a cached token */
    const int64_t len = t_end - t_first;
    /* This item's query heads are consecutive: kv_first * group .. kv_end * group. */
    const float *q_item = q + kv_first * group * head_dim;
    float *out_item = out + kv_first * group * head_dim;
    float tile[8 * KV_TILE_DIM]; /* 8 converted rows of one KV head */
    int8_t qq[Q8_ITEM_VALUES]; /* the item's query heads in 8 bits, and their scales per block of 32 */
    float qd[Q8_ITEM_VALUES / 32];
    const int64_t nb = head_dim / 32;
    const int q8 = type == KV_Q8_0 && num_item_heads * head_dim <= Q8_ITEM_VALUES && head_dim <= KV_TILE_DIM;
    if (q8) round_query_q8(q_item, num_item_heads * head_dim, qq, qd);

    /* Pass 1: raw scores q . k of every cached token and head of the item, a block at a time
     * (its tokens' rows are consecutive), 8 tokens at a time: their K rows are read once from
     * memory and then from L1 for every head, and their 8 dot products come out as one vector. */
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t n_t = len - t0 < block_size ? len - t0 : block_size;
        const uint8_t *k_block = k_cache + (int64_t)table[(t_first + t0) / block_size] * block_size * token_stride;
        if (t0 == 0) prefetch_start(k_cache, table, t_first, len, block_size, token_stride, kv_first * row, item_bytes);
        int64_t t = 0;
        if (q8) /* every row of the block, 8 at a time, the last chunk possibly shorter */
            for (; t < n_t; t += 8) {
                const Ahead ahead = rows_ahead(k_cache, table, t_first, t0 + t + PREFETCH_TOKENS, len, block_size,
                                               token_stride, kv_first * row, item_bytes);
                const int64_t n = n_t - t < 8 ? n_t - t : 8;
                for (int64_t kh = kv_first; kh < kv_end; kh++) {
                    const uint8_t *rows = k_block + t * token_stride + kh * row;
                    const int64_t h0 = (kh - kv_first) * group;
                    if (dot_chunk_q8(group, qq + h0 * head_dim, qd + h0 * nb, rows, token_stride, nb, n,
                                     scores + h0 * scores_stride + t0 + t, scores_stride, &ahead, kh - kv_first,
                                     kv_end - kv_first))
                        continue;
                    float kd[8 * (KV_TILE_DIM / 32)];
                    q8_row_scales(rows, token_stride, nb, n, kd);
                    for (int64_t h = (kh - kv_first) * group; h < (kh - kv_first + 1) * group; h++) {
                        prefetch_part(&ahead, h, num_item_heads);
                        dot_rows_q8(qq + h * head_dim, qd + h * nb, rows, token_stride, nb, n, kd,
                                    scores + h * scores_stride + t0 + t);
                    }
                }
            }
        for (; t + 8 <= n_t; t += 8) {
            const Ahead ahead = rows_ahead(k_cache, table, t_first, t0 + t + PREFETCH_TOKENS, len, block_size,
                                           token_stride, kv_first * row, item_bytes);
            if (grouped_float(type, group, head_dim)) {
                for (int64_t kh = kv_first; kh < kv_end; kh++) {
                    const int64_t h0 = (kh - kv_first) * group;
                    dot_group(type, group, q_item + h0 * head_dim, k_block + t * token_stride + kh * row,
                              token_stride, head_dim, scores + h0 * scores_stride + t0 + t, scores_stride, &ahead,
                              kh - kv_first, kv_end - kv_first);
                }
                continue;
            }
            if (!converts_once(type, group, head_dim)) {
                for (int64_t h = 0; h < num_item_heads; h++) {
                    prefetch_part(&ahead, h, num_item_heads);
                    dot_8rows(type, q_item + h * head_dim, k_block + t * token_stride + (kv_first + h / group) * row,
                              token_stride, head_dim, scores + h * scores_stride + t0 + t);
                }
                continue;
            }
            /* Grouped heads: the 8 rows of each KV head converted once, then read as fp32 from L1
             * by each of its query heads (converting them per query head cost more than the reading). */
            for (int64_t kh = kv_first; kh < kv_end; kh++) {
                rows_to_f32(type, k_block + t * token_stride + kh * row, token_stride, 8, head_dim, tile);
                for (int64_t h = (kh - kv_first) * group; h < (kh - kv_first + 1) * group; h++) {
                    prefetch_part(&ahead, h, num_item_heads);
                    dot_8rows(KV_F32, q_item + h * head_dim, (const uint8_t *)tile, 4 * head_dim, head_dim,
                              scores + h * scores_stride + t0 + t);
                }
            }
        }
        for (; t < n_t; t++)
            for (int64_t h = 0; h < num_item_heads; h++)
                scores[h * scores_stride + t0 + t] =
                    dot_row(type, q_item + h * head_dim, k_block + t * token_stride + (kv_first + h / group) * row,
                            head_dim);
    }
    /* Softmax numerators per head, exp(scale * (s - max)) (scale > 0, so the max of the raw scores
     * is the max of the scaled ones); the division comes at the end. */
    for (int64_t h = 0; h < num_item_heads; h++) {
        float *srow = scores + h * scores_stride;
        float m = -INFINITY;
        for (int64_t t = 0; t < skip; t++) srow[t] = -INFINITY; /* exp() makes them 0 */
        if (softcap > 0.0f) /* Gemma 2: scaled scores capped to (-softcap, softcap) by a tanh */
            for (int64_t t = skip; t < len; t++) srow[t] = softcap * tanhf(srow[t] * scale / softcap) / scale;
        for (int64_t t = skip; t < len; t++) m = srow[t] > m ? srow[t] : m;
        vf sum = {0};
        int64_t t = 0;
        for (; t + VL <= len; t += VL) {
            const vf e = vexp((load_f32(srow + t) - m) * scale);
            store_f32(srow + t, e);
            sum += e;
        }
        float s = hsum(sum);
        for (; t < len; t++) {
            srow[t] = sexp((srow[t] - m) * scale);
            s += srow[t];
        }
        /* an attention sink: a per-head logit in the denominator only (a split plan adds it when merging) */
        if (sinks != NULL && part_max == NULL) s += sexp(sinks[kv_first * group + h] - m * scale);
        inv_sum[h] = 1.0f / s;
        if (part_max != NULL) part_max[kv_first * group + h] = m * scale, part_sum[kv_first * group + h] = s;
        memset(out_item + h * head_dim, 0, sizeof(float) * (size_t)head_dim);
    }
    /* Pass 2: out = sum_t p_t v_t, a block and 8 tokens at a time: each head's output vector is
     * loaded once per 8 tokens, their V rows come from memory once for all of the item's heads. */
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t n_t = len - t0 < block_size ? len - t0 : block_size;
        const uint8_t *v_block = v_cache + (int64_t)table[(t_first + t0) / block_size] * block_size * token_stride;
        if (t0 == 0) prefetch_start(v_cache, table, t_first, len, block_size, token_stride, kv_first * row, item_bytes);
        for (int64_t t = 0; t < n_t; t += 8) {
            const int64_t nt = n_t - t < 8 ? n_t - t : 8;
            const Ahead ahead = rows_ahead(v_cache, table, t_first, t0 + t + PREFETCH_TOKENS, len, block_size,
                                           token_stride, kv_first * row, item_bytes);
            if (q8) {
                for (int64_t kh = kv_first; kh < kv_end; kh++) {
                    const int64_t h0 = (kh - kv_first) * group;
                    accumulate_q8(group, v_block + t * token_stride + kh * row, token_stride, nt, nb,
                                  scores + h0 * scores_stride + t0 + t, scores_stride, out_item + h0 * head_dim,
                                  head_dim, &ahead, kh - kv_first, kv_end - kv_first);
                }
                continue;
            }
            if (grouped_float(type, group, head_dim)) {
                for (int64_t kh = kv_first; kh < kv_end; kh++) {
                    const int64_t h0 = (kh - kv_first) * group;
                    accumulate_group(type, group, v_block + t * token_stride + kh * row, token_stride, nt,
                                     scores + h0 * scores_stride + t0 + t, scores_stride, out_item + h0 * head_dim,
                                     head_dim, &ahead, kh - kv_first, kv_end - kv_first);
                }
                continue;
            }
            const int converted = converts_once(type, group, head_dim);
            for (int64_t h = 0; h < num_item_heads; h++) {
                prefetch_part(&ahead, h, num_item_heads);
                const uint8_t *v = v_block + t * token_stride + (kv_first + h / group) * row;
                const float *p = scores + h * scores_stride + t0 + t;
                float *o = out_item + h * head_dim;
                if (converted) { /* the group's first head converts its KV head's rows, all read them */
                    if (h % group == 0) rows_to_f32(type, v, token_stride, nt, head_dim, tile);
                    accumulate_rows(tile, nt, head_dim, p, o);
                    continue;
                }
                int64_t d = 0;
                if (type == KV_Q8_0) /* per block of 32: each token's weight times its scale, once */
                    for (; d < head_dim; d += 32) {
                        float w[8];
                        for (int64_t i = 0; i < nt; i++) w[i] = p[i] * f16x1(v + i * token_stride + d / 32 * 34);
                        for (int c = 0; c < 32; c += VL) {
                            vf acc = load_f32(o + d + c);
                            for (int64_t i = 0; i < nt; i++)
                                acc += w[i] * i8x8(v + i * token_stride + d / 32 * 34 + 2 + c);
                            store_f32(o + d + c, acc);
                        }
                    }
                for (; d + VL <= head_dim; d += VL) {
                    vf acc = load_f32(o + d);
                    for (int64_t i = 0; i < nt; i++) acc += p[i] * kv_load8(type, v + i * token_stride, d);
                    store_f32(o + d, acc);
                }
                for (; d < head_dim; d++)
                    for (int64_t i = 0; i < nt; i++) o[d] += p[i] * kv_load1(type, v + i * token_stride, d);
            }
        }
    }
    if (part_max != NULL) return;
    for (int64_t h = 0; h < num_item_heads; h++) {
        float *o = out_item + h * head_dim;
        for (int64_t d = 0; d < head_dim; d++) o[d] *= inv_sum[h];
    }
}

/* One copy of a body per format: NAME_t(KV_X, args...) with the format a constant. */
#define KV_DISPATCH(CALL_T, type, ...)                                  \
    switch (type) {                                                     \
    case KV_F32: CALL_T(KV_F32, __VA_ARGS__); break;                    \
    case KV_BF16: CALL_T(KV_BF16, __VA_ARGS__); break;                  \
    case KV_F16: CALL_T(KV_F16, __VA_ARGS__); break;                    \
    case KV_Q8_0: CALL_T(KV_Q8_0, __VA_ARGS__); break;                  \
    case KV_E4M3: CALL_T(KV_E4M3, __VA_ARGS__); break;                  \
    default: CALL_T(KV_E5M2, __VA_ARGS__); break;                       \
    }

static void attend_item(const float *q, const void *k_cache, const void *v_cache, int64_t kv_type,
                        const int32_t *table, int64_t t_first, int64_t t_end, float *out, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t kv_first, int64_t kv_end,
                        float scale, float *scores, int64_t scores_stride, float *inv_sum, float *part_max,
                        float *part_sum, int64_t skip, float softcap, const float *sinks) {
    KV_DISPATCH(attend_item_t, kv_type, q, k_cache, v_cache, table, t_first, t_end, out, num_heads, num_kv_heads,
                head_dim, block_size, kv_first, kv_end, scale, scores, scores_stride, inv_sum, part_max, part_sum,
                skip, softcap, sinks)
}

/* ---- the work items of a decode step -----------------------------------------------------------
 * Many sequences: whole sequences per item (or a sequence's KV heads in chunks, so that about 4
 * items per thread exist; not one KV head per item where it can be helped: a cached token's row
 * would be read in pieces). Few sequences behind long contexts (fewer than 4 per thread, contexts
 * from 2 x SPLIT_MIN_TOKENS): every KV head of a sequence per item and its tokens split in chunks of whole blocks
 * (flash-decoding): each item then streams whole token rows, which the hardware prefetcher follows,
 * instead of one head's row a page apart per token, and one sequence keeps every core busy. The
 * chunks' partial softmaxes are merged after. */
#define SPLIT_MIN_TOKENS 512 /* below this, a chunk's fixed costs outweigh its share of the reading */

DecodePlan decode_plan(int64_t num_seqs, int64_t num_kv_heads, int64_t max_context, int64_t block_size,
                       int num_threads) {
    DecodePlan p = {num_kv_heads, max_context, 1};
    const int64_t wanted = 4 * (int64_t)num_threads; /* items */
    if (num_seqs < wanted && max_context >= 2 * SPLIT_MIN_TOKENS) {
        int64_t splits = (wanted + num_seqs - 1) / num_seqs;
        if (splits > max_context / SPLIT_MIN_TOKENS) splits = max_context / SPLIT_MIN_TOKENS;
        const int64_t blocks = (max_context + block_size - 1) / block_size;
        p.chunk = (blocks + splits - 1) / splits * block_size;
        p.splits = (max_context + p.chunk - 1) / p.chunk;
        return p;
    }
    int64_t head_splits = (wanted + num_seqs - 1) / num_seqs;
    head_splits = head_splits < num_kv_heads ? head_splits : num_kv_heads;
    p.kv_heads_per_item = (num_kv_heads + head_splits - 1) / head_splits;
    return p;
}

int64_t decode_scratch_floats(const DecodePlan *p, int64_t group) {
    const int64_t heads = p->kv_heads_per_item * group;
    return heads * p->chunk + heads;
}

int64_t decode_partial_floats(const DecodePlan *p, int64_t num_seqs, int64_t num_heads, int64_t head_dim) {
    return p->splits > 1 ? num_seqs * p->splits * num_heads * (head_dim + 2) : 0;
}

/* out[h] (b's) = the chunks' shares of each head merged: sum_i e^(m_i - M) o_i / sum_i e^(m_i - M) l_i
 * (+ e^(sink - M) in the denominator with an attention sink). */
static void merge_parts(const float *parts, int64_t splits, int64_t used, int64_t num_heads, int64_t head_dim,
                        int64_t h, const float *sinks, float *out) {
    const float *pmax = parts + splits * num_heads * head_dim, *psum = pmax + splits * num_heads;
    float m = -INFINITY, l = 0.0f;
    for (int64_t i = 0; i < used; i++) m = pmax[i * num_heads + h] > m ? pmax[i * num_heads + h] : m;
    memset(out, 0, sizeof(float) * (size_t)head_dim);
    for (int64_t i = 0; i < used; i++) {
        const float w = sexp(pmax[i * num_heads + h] - m);
        l += w * psum[i * num_heads + h];
        const float *o = parts + (i * num_heads + h) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) out[d] += w * o[d];
    }
    if (sinks != NULL) l += sexp(sinks[h] - m);
    const float inv = 1.0f / l;
    for (int64_t d = 0; d < head_dim; d++) out[d] *= inv;
}

void phase_decode_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                            int64_t kv_type, const int32_t *block_tables, int64_t max_blocks,
                            const int32_t *context_lens, float *out, int64_t out_stride, int64_t num_seqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            float scale, int64_t window, float softcap, const float *sinks, const DecodePlan *p,
                            float *scratch, float *parts, ItemPrepare prepare, const void *ctx) {
    const int64_t group = num_heads / num_kv_heads, per_item = p->kv_heads_per_item;
    const int64_t head_items = (num_kv_heads + per_item - 1) / per_item, items = num_seqs * head_items * p->splits;
    float *inv_sum = scratch + per_item * group * p->chunk;
    /* one sequence's partials: [splits][num_heads][head_dim] shares, then [splits][num_heads] maxima, sums */
    const int64_t seq_parts = p->splits * num_heads * (head_dim + 2);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++) {
        if (scratch == NULL) continue;
        const int64_t b = item / (head_items * p->splits), rest = item % (head_items * p->splits);
        const int64_t kv_first = rest / p->splits * per_item, split = rest % p->splits;
        const int64_t kv_end = kv_first + per_item < num_kv_heads ? kv_first + per_item : num_kv_heads;
        const int64_t len = context_lens[b];
        /* A sliding window sees the last `window` tokens: the items start at its first block (lo),
         * the tokens of that block before the window (skip) given no weight. */
        const int64_t start = window > 0 && len > window ? len - window : 0, lo = start / block_size * block_size;
        const int64_t t_first = lo + split * p->chunk;
        if (prepare != NULL) prepare(ctx, b, kv_first, kv_end);
        if (t_first >= len) continue;
        const int64_t t_end = t_first + p->chunk < len ? t_first + p->chunk : len;
        const int64_t skip = split == 0 ? start - lo : 0;
        const float *qb = q + b * q_stride;
        const int32_t *table = block_tables + b * max_blocks;
        if (p->splits == 1) {
            attend_item(qb, k_cache, v_cache, kv_type, table, t_first, len, out + b * out_stride, num_heads,
                        num_kv_heads, head_dim, block_size, kv_first, kv_end, scale, scratch, p->chunk, inv_sum, NULL,
                        NULL, skip, softcap, sinks);
        } else {
            float *mine = parts + b * seq_parts, *share = mine + split * num_heads * head_dim;
            float *pmax = mine + p->splits * num_heads * head_dim + split * num_heads;
            attend_item(qb, k_cache, v_cache, kv_type, table, t_first, t_end, share, num_heads, num_kv_heads,
                        head_dim, block_size, kv_first, kv_end, scale, scratch, p->chunk, inv_sum,
                        pmax, pmax + p->splits * num_heads, skip, softcap, sinks);
        }
    }
    if (p->splits == 1) return;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < num_seqs * num_heads; i++) {
        const int64_t b = i / num_heads, h = i % num_heads, len = context_lens[b];
        const int64_t start = window > 0 && len > window ? len - window : 0;
        const int64_t used = (len - start / block_size * block_size + p->chunk - 1) / p->chunk;
        merge_parts(parts + b * seq_parts, p->splits, used, num_heads, head_dim, h, sinks,
                    out + b * out_stride + h * head_dim);
    }
}

int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int64_t kv_type,
                           const int32_t *block_tables, const int32_t *context_lens, float *out, int64_t num_seqs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           int64_t max_blocks, int64_t max_context, float scale, int64_t window, float softcap,
                           const float *sinks, int num_threads) {
    if (kv_row_bytes(kv_type, head_dim) == 0) return 2;
    /* With a window, an item reads at most window + block_size - 1 tokens (from the window's first block). */
    if (window > 0 && max_context > window + block_size) max_context = window + block_size;
    const DecodePlan plan = decode_plan(num_seqs, num_kv_heads, max_context, block_size, num_threads);
    float *parts = NULL;
    const int64_t partial = decode_partial_floats(&plan, num_seqs, num_heads, head_dim);
    if (partial > 0 && (parts = malloc(sizeof(float) * (size_t)partial)) == NULL) return 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc(sizeof(float) * (size_t)decode_scratch_floats(&plan, num_heads / num_kv_heads));
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        phase_decode_attention(q, num_heads * head_dim, k_cache, v_cache, kv_type, block_tables, max_blocks,
                               context_lens, out, num_heads * head_dim, num_seqs, num_heads, num_kv_heads, head_dim,
                               block_size, scale, window, softcap, sinks, &plan, scratch, parts, NULL, NULL);
        free(scratch);
    }
    free(parts);
    return failed;
}
