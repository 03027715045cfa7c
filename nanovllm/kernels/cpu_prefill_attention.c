/* Prefill attention over an int8 (q8_0) KV cache on the CPU: each sequence's new tokens over its
 * cached keys and values (the new ones stored first), causal, read in place through the block table.
 *
 * Why a kernel of its own: over a 16- or 32-bit cache prefill is torch's SDPA (flash attention on
 * fp32, MKL's sgemm at ~83% of the fp32 FMA peak: no fp32 kernel of ours would be much faster). Over
 * int8 rows the scores are integer dot products, as in decode (cpu_attention.c, q8_block_dot): the
 * query rounded to 8 bits per block of 32 (KVFormat.round_query), q . k per block summed exactly in
 * int32, times the two scales. Integer multiply-adds of 16-bit pairs (vpmaddwd: 16 products per
 * instruction, two per cycle on the cores measured) run at twice the rate of fp32 FMAs, so Q K^T
 * takes half the time; P V too, with the probabilities (times the values' block scales) rounded to
 * 16 bits per key tile against a per-row bound: the kernel's one approximation (~1e-4 on outputs of
 * size 1, where the int8 values themselves are ~1e-2 from the unrounded ones).
 *
 * Work items: (sequence, KV head, tile of QT query tokens), the latest tiles (the most keys) first,
 * dynamically over OpenMP threads. An item holds the rows of its tokens for every query head of
 * its KV head's group (GQA: the keys are read and repacked once for all of them) and walks its keys
 * in tiles of KT (flash attention's online softmax, fp32): each tile's keys repacked to 16-bit
 * pairs interleaved over 8 keys (one vector = pair p of 8 keys, so a broadcast query pair times it
 * gives 8 keys' partial sums in 8 lanes: no horizontal sums), its values to 16-bit token pairs.
 *
 * Layouts as in cpu_attention.c: q, out [num_tokens, num_heads, head_dim] fp32 (the sequences' new
 * tokens one after another), caches [num_blocks, block_size, num_kv_heads, head_dim / 32 * 34]. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_kv_formats.h"

#define PF_KT 128      /* keys per tile */
#define PF_ROWS 128    /* query rows (tokens x heads of a group) an item aims at */
#define PF_MAX_DIM 512 /* head_dim limit (a multiple of 32) */

typedef struct {
    int16_t *q;   /* [nb][rows][32]: the query rounded to int8 (as int16, the multiply-add's operand) */
    float *qd;    /* [rows][nb]: its block scales times the softmax scale */
    float *o;     /* [rows][D]: sum_j p_j v_j so far */
    float *m, *l, *corr; /* [rows]: running max, running sum, this tile's rescaling */
    float *s;     /* [rows][KT]: scores, then probabilities */
    int16_t *k;   /* [KT / 8][nb][16 pairs][8 keys][2]: the key tile, interleaved */
    float *kd;    /* [KT / 8][nb][8]: the key tile's block scales */
    int16_t *v;   /* [KT / 2][D / 8][8 values][2 tokens]: the value tile, token pairs interleaved */
    float *vd;    /* [nb][KT]: the value tile's block scales */
    float *vdn;   /* [nb][KT]: the same times 32767 / vdmax[b] */
    int16_t *p;   /* [nb][rows][KT]: probabilities times the value scales, rounded to 16 bits */
    float *ps;    /* [rows][nb]: their scales */
    float vdmax[PF_MAX_DIM / 32]; /* per block, the value tile's largest scale */
    void *base;   /* the one allocation all of the above point into */
} Scratch;

static inline const uint8_t *cache_row(const uint8_t *cache, const int32_t *table, int64_t j, int64_t block_size,
                                       int64_t num_kv_heads, int64_t kvh, int64_t row_bytes) {
    return cache + (((int64_t)table[j / block_size] * block_size + j % block_size) * num_kv_heads + kvh) * row_bytes;
}

/* Rows r = t * G + g (t < nt tokens, g < G heads from h0) of q rounded per block of 32 exactly as
 * cpu_attention.c's round_query_q8 (d = max|x| / 127, q = round(x / d) to nearest even), block-major
 * (qq[b][r][32]: the inner loops find 4 rows' values at fixed offsets from one pointer); rows up to
 * padded are zero. */
static void round_rows(const float *q, int64_t q_stride, int64_t nt, int64_t h0, int64_t G, int64_t D, float scale,
                       int64_t padded, int16_t *qq, float *qd) {
    const int64_t nb = D / 32;
    for (int64_t r = 0; r < padded; r++) {
        if (r >= nt * G) {
            for (int64_t b = 0; b < nb; b++) {
                memset(qq + (b * padded + r) * 32, 0, sizeof(int16_t) * 32);
                qd[r * nb + b] = 0.0f;
            }
            continue;
        }
        const float *x = q + (r / G) * q_stride + (h0 + r % G) * D;
        for (int64_t b = 0; b < nb; b++) {
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) amax = fabsf(x[b * 32 + j]) > amax ? fabsf(x[b * 32 + j]) : amax;
            const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
            qd[r * nb + b] = d * scale;
            for (int j = 0; j < 32; j++) qq[(b * padded + r) * 32 + j] = (int16_t)nearbyintf(x[b * 32 + j] * inv);
        }
    }
}

/* ---- the instruction-set parts: AVX2 (with VNNI's one-instruction multiply-add), plain C ---------
 * Each a whole function under a file-level guard: the key and value tiles' repacking (8 keys' rows
 * into one block's interleaved pairs; two tokens' rows into interleaved pairs), the scores of 4 rows
 * with 8 or 16 keys, and P V for 4 rows and 16 values. */
#if KV_F16C && ISA_AVX512VNNI && ISA_AVX512VL
/* acc + the 16-bit pair products of x and y summed per 32-bit lane. */
static inline __m256i madd_add(__m256i acc, __m256i x, __m256i y) { return _mm256_dpwssd_epi32(acc, x, y); }
#elif KV_F16C
static inline __m256i madd_add(__m256i acc, __m256i x, __m256i y) {
    /* in asm: GCC otherwise sums into a new register and moves it back, a third instruction */
    __m256i t;
    __asm__("vpmaddwd %3, %2, %1\n\tvpaddd %1, %0, %0" : "+x"(acc), "=&x"(t) : "x"(x), "x"(y));
    return acc;
}
#endif

#if KV_F16C
/* r[p] = lane p of every r[i] (an 8 x 8 transpose of 32-bit lanes). */
static inline void transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x20);
        r[4 + i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x31);
    }
}

/* The 16-bit pair at p broadcast to every 32-bit lane. */
static inline __m256i pair_at(const int16_t *p) {
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    return _mm256_set1_epi32(pair);
}

/* dst[p][i][e] = value 2p + e of block b of rows[i] (0 where rows[i] is NULL), p < 16, i < 8. */
static inline void pack_key_block(const uint8_t *const rows[8], int64_t b, int16_t *dst) {
    __m256i lo[8], hi[8]; /* per key: pairs 0-7, pairs 8-15 */
    for (int i = 0; i < 8; i++) {
        if (rows[i] == NULL) {
            lo[i] = hi[i] = _mm256_setzero_si256();
            continue;
        }
        const uint8_t *x = rows[i] + b * 34 + 2;
        lo[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x));
        hi[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(x + 16)));
    }
    transpose8(lo);
    transpose8(hi);
    for (int p = 0; p < 8; p++) {
        _mm256_storeu_si256((__m256i *)(dst + p * 16), lo[p]);
        _mm256_storeu_si256((__m256i *)(dst + (8 + p) * 16), hi[p]);
    }
}

/* dst[d][e] = value d of block blk of row e (a, then b), d < 32. */
static inline void pack_value_block(const uint8_t *a, const uint8_t *b, int64_t blk, int16_t *dst) {
    for (int c = 0; c < 32; c += 16) {
        const __m128i x = _mm_loadu_si128((const __m128i *)(a + blk * 34 + 2 + c));
        const __m128i y = _mm_loadu_si128((const __m128i *)(b + blk * 34 + 2 + c));
        _mm256_storeu_si256((__m256i *)(dst + c * 2), _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(x, y)));
        _mm256_storeu_si256((__m256i *)(dst + (c + 8) * 2), _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(x, y)));
    }
}

/* s[r][8c + i] = scores of 4 rows (q, qd from row r0) with the 8 keys i of key groups c < NK
 * (group c's k, kd at c * nb * 256, c * nb * 8). Per block, the int32 sums of 4 rows x 8 NK keys in
 * registers (two key vectors per broadcast query pair: 6 loads per 8 multiply-adds); scaled into s
 * after each block. */
static inline __attribute__((always_inline)) void scores_t(const int NK, const int16_t *q, const float *qd, int64_t qb,
                                                           int64_t nb, const int16_t *k, const float *kd, float *s,
                                                           int64_t s_stride) {
    for (int64_t b = 0; b < nb; b++) {
        __m256i a[4][2];
        for (int r = 0; r < 4; r++)
            for (int c = 0; c < NK; c++) a[r][c] = _mm256_setzero_si256();
        for (int p = 0; p < 16; p++) {
            __m256i kv[2];
            for (int c = 0; c < NK; c++) kv[c] = _mm256_loadu_si256((const __m256i *)(k + c * nb * 256 + b * 256 + p * 16));
            for (int r = 0; r < 4; r++) {
                const __m256i qp = pair_at(q + b * qb + r * 32 + 2 * p);
                for (int c = 0; c < NK; c++) a[r][c] = madd_add(a[r][c], kv[c], qp);
            }
        }
        for (int c = 0; c < NK; c++) {
            const __m256 kdv = _mm256_loadu_ps(kd + c * nb * 8 + b * 8);
            for (int r = 0; r < 4; r++) {
                float *dst = s + r * s_stride + c * 8;
                const __m256 x = _mm256_mul_ps(_mm256_cvtepi32_ps(a[r][c]), _mm256_mul_ps(kdv, _mm256_set1_ps(qd[r * nb + b])));
                _mm256_storeu_ps(dst, b == 0 ? x : _mm256_add_ps(_mm256_loadu_ps(dst), x));
            }
        }
    }
}

/* o[r][0, 16) = o[r] corr[r] + ps * sum_j p[r][j] v[j][0, 16) for 4 rows (o, p: row r at o + r * o_stride,
 * p + r * p_stride; corr[r], ps[r * ps_stride]) over token pairs of v (v + jp * v_stride). */
static inline void pv_rows4(float *o, int64_t o_stride, const int16_t *p, int64_t p_stride, const int16_t *v,
                            int64_t v_stride, int64_t pairs, const float *corr, const float *ps, int64_t ps_stride) {
    __m256i acc[4][2];
    for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const int16_t *p0 = p, *p1 = p0 + p_stride, *p2 = p1 + p_stride, *p3 = p2 + p_stride;
    for (int64_t jp = 0; jp < pairs; jp++) {
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)(v + jp * v_stride));
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(v + jp * v_stride + 16));
        acc[0][0] = madd_add(acc[0][0], v0, pair_at(p0 + 2 * jp));
        acc[0][1] = madd_add(acc[0][1], v1, pair_at(p0 + 2 * jp));
        acc[1][0] = madd_add(acc[1][0], v0, pair_at(p1 + 2 * jp));
        acc[1][1] = madd_add(acc[1][1], v1, pair_at(p1 + 2 * jp));
        acc[2][0] = madd_add(acc[2][0], v0, pair_at(p2 + 2 * jp));
        acc[2][1] = madd_add(acc[2][1], v1, pair_at(p2 + 2 * jp));
        acc[3][0] = madd_add(acc[3][0], v0, pair_at(p3 + 2 * jp));
        acc[3][1] = madd_add(acc[3][1], v1, pair_at(p3 + 2 * jp));
    }
    for (int r = 0; r < 4; r++) {
        float *out = o + r * o_stride;
        const vf c = (vf){0} + corr[r], sc = (vf){0} + ps[r * ps_stride];
        store_f32(out, load_f32(out) * c + (vf)_mm256_cvtepi32_ps(acc[r][0]) * sc);
        store_f32(out + 8, load_f32(out + 8) * c + (vf)_mm256_cvtepi32_ps(acc[r][1]) * sc);
    }
}

/* The largest of s[0, seen), seen > 0. */
static inline float row_max(const float *s, int64_t seen) {
    __m256 mx = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= seen; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
    float m = mx[0];
    for (int e = 1; e < 8; e++) m = mx[e] > m ? mx[e] : m;
    for (; j < seen; j++) m = s[j] > m ? s[j] : m;
    return m;
}

/* e^x for x <= 0 (below -87 as e^-87), to the 16-bit rounding that follows: exp_reduce's range
 * reduction with a degree-5 polynomial (relative error < 3e-6 where vexp's degree 7 gives 1e-8),
 * 2^n added into the exponent bits (e^r is within [0.7, 1.42], n >= -126: a normal result). */
static inline __m256 exp_unit8(__m256 x) {
    vf n;
    const vf r = exp_reduce((vf)_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), &n);
    const __m256 p = (__m256)exp_taylor(r, 5);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32((__m256)n), 23)));
}

/* e^(s_j - m) for the 8 keys from j (0 from seen on). */
static inline __m256 probs8(const float *s, int64_t j, int64_t seen, __m256 m) {
    if (j >= seen) return _mm256_setzero_ps();
    const __m256 e = exp_unit8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
    if (j + 8 <= seen) return e;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(seen - j)), lane)));
}

/* p[b * pb + j] = round(e^(s_j - m) vdn[b][j]) (to nearest) for j < seen, 0 for seen <= j < n
 * rounded up to 16, every block b < nb; returns the sum of the e^(s_j - m). 16 keys a pass: two
 * vectors' rounded products packed into one store. */
static inline float row_probs(const float *s, int64_t seen, int64_t n, float m, const float *vdn, int64_t nb,
                              int16_t *p, int64_t pb) {
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __m256 e0 = probs8(s, j, seen, mv), e1 = probs8(s, j + 8, seen, mv);
        sum = _mm256_add_ps(sum, _mm256_add_ps(e0, e1));
        for (int64_t b = 0; b < nb; b++) {
            const __m256i x0 = _mm256_cvtps_epi32(_mm256_mul_ps(e0, _mm256_loadu_ps(vdn + b * PF_KT + j)));
            const __m256i x1 = _mm256_cvtps_epi32(_mm256_mul_ps(e1, _mm256_loadu_ps(vdn + b * PF_KT + j + 8)));
            /* (packs interleaves the 128-bit halves: the permute puts keys back in order) */
            _mm256_storeu_si256((__m256i *)(p + b * pb + j), _mm256_permute4x64_epi64(_mm256_packs_epi32(x0, x1), 0xD8));
        }
    }
    return hsum((vf)sum);
}
#else
static inline void pack_key_block(const uint8_t *const rows[8], int64_t b, int16_t *dst) {
    for (int p = 0; p < 16; p++)
        for (int i = 0; i < 8; i++)
            for (int e = 0; e < 2; e++) dst[p * 16 + i * 2 + e] = rows[i] != NULL ? (int8_t)rows[i][b * 34 + 2 + 2 * p + e] : 0;
}

static inline void pack_value_block(const uint8_t *a, const uint8_t *b, int64_t blk, int16_t *dst) {
    for (int d = 0; d < 32; d++) {
        dst[d * 2] = (int8_t)a[blk * 34 + 2 + d];
        dst[d * 2 + 1] = (int8_t)b[blk * 34 + 2 + d];
    }
}

static inline void scores_t(const int NK, const int16_t *q, const float *qd, int64_t qb, int64_t nb, const int16_t *k,
                            const float *kd, float *s, int64_t s_stride) {
    for (int c = 0; c < NK; c++)
        for (int r = 0; r < 4; r++)
            for (int i = 0; i < 8; i++) {
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    int32_t a = 0;
                    for (int j = 0; j < 32; j++)
                        a += q[b * qb + r * 32 + j] * k[c * nb * 256 + b * 256 + (j / 2) * 16 + i * 2 + j % 2];
                    acc += (float)a * (kd[c * nb * 8 + b * 8 + i] * qd[r * nb + b]);
                }
                s[r * s_stride + c * 8 + i] = acc;
            }
}

static inline void pv_rows4(float *o, int64_t o_stride, const int16_t *p, int64_t p_stride, const int16_t *v,
                            int64_t v_stride, int64_t pairs, const float *corr, const float *ps, int64_t ps_stride) {
    for (int r = 0; r < 4; r++)
        for (int x = 0; x < 16; x++) {
            int32_t a = 0;
            for (int64_t j = 0; j < 2 * pairs; j++) a += p[r * p_stride + j] * v[(j / 2) * v_stride + x * 2 + j % 2];
            o[r * o_stride + x] = o[r * o_stride + x] * corr[r] + (float)a * ps[r * ps_stride];
        }
}
/* e^x for x <= 0 (lanes below -87 as e^-87), to the 16-bit rounding that follows it: vexp's range
 * reduction with a degree-5 polynomial (relative error < 3e-6 where vexp's degree 7 gives 1e-8). */
static inline vf exp_unit(vf x) {
    const vf lo = (vf){0} - 87.0f;
    vf n;
    const vf r = exp_reduce(vselect(x < lo, lo, x), &n);
    return exp_scale(exp_taylor(r, 5), n);
}

static inline float row_max(const float *s, int64_t seen) {
    float m = s[0];
    for (int64_t j = 1; j < seen; j++) m = s[j] > m ? s[j] : m;
    return m;
}

/* (as the AVX2 part, VL keys at a time) */
static inline float row_probs(const float *s, int64_t seen, int64_t n, float m, const float *vdn, int64_t nb,
                              int16_t *p, int64_t pb) {
    vi lane;
    for (int e = 0; e < VL; e++) lane[e] = e;
    vf sum = (vf){0};
    for (int64_t i = 0; i < (n + 15) / 16 * 16 / VL; i++) {
        const vf e = vselect(lane + (int32_t)(i * VL) < (vi){0} + (int32_t)seen, exp_unit(load_f32(s + i * VL) - m),
                             (vf){0});
        sum += e;
        for (int64_t b = 0; b < nb; b++) {
            const vf x = e * load_f32(vdn + b * PF_KT + i * VL);
            for (int l = 0; l < VL; l++) p[b * pb + i * VL + l] = (int16_t)nearbyintf(x[l]);
        }
    }
    return hsum(sum);
}
#endif

/* ---- the tiles ---------------------------------------------------------------------------------- */
/* Keys [j0, j0 + n) of one KV head into the tile: k[g][b][p][i][e] = value 2p + e of block b of key
 * 8g + i (0 past n), kd[g][b][i] its block's scale. */
static void pack_keys(const uint8_t *cache, const int32_t *table, int64_t j0, int64_t n, int64_t block_size,
                      int64_t num_kv_heads, int64_t kvh, int64_t nb, int16_t *k, float *kd) {
    for (int64_t g = 0; g < (n + 7) / 8; g++) {
        const uint8_t *rows[8];
        for (int i = 0; i < 8; i++)
            rows[i] = g * 8 + i < n ? cache_row(cache, table, j0 + g * 8 + i, block_size, num_kv_heads, kvh, nb * 34)
                                    : NULL;
        for (int64_t b = 0; b < nb; b++) {
            float *kdb = kd + (g * nb + b) * 8;
            for (int i = 0; i < 8; i++) kdb[i] = rows[i] != NULL ? f16x1(rows[i] + b * 34) : 0.0f;
            pack_key_block(rows, b, k + (g * nb + b) * 256);
        }
    }
}

/* Scores of 4 rows with the keys of `groups` key groups, two at a time. */
static void scores_rows4(const int16_t *q, const float *qd, int64_t qb, int64_t nb, const int16_t *k, const float *kd,
                         int64_t groups, float *s, int64_t s_stride) {
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2)
        scores_t(2, q, qd, qb, nb, k + g * nb * 256, kd + g * nb * 8, s + g * 8, s_stride);
    if (g < groups) scores_t(1, q, qd, qb, nb, k + g * nb * 256, kd + g * nb * 8, s + g * 8, s_stride);
}

/* Values [j0, j0 + n) of one KV head into the tile: v[jp][c][d][e] = value 8c + d of token 2jp + e
 * (0 past n), vd[b][j] the scale of block b of token j, vdmax[b] the largest of them. */
static void pack_values(const uint8_t *cache, const int32_t *table, int64_t j0, int64_t n, int64_t block_size,
                        int64_t num_kv_heads, int64_t kvh, int64_t nb, int16_t *v, float *vd, float *vdmax) {
    const int64_t D = nb * 32;
    static const uint8_t zeros[PF_MAX_DIM / 32 * 34];
    for (int64_t blk = 0; blk < nb; blk++) vdmax[blk] = 0.0f;
    for (int64_t jp = 0; jp < (n + 1) / 2; jp++) {
        const uint8_t *a = cache_row(cache, table, j0 + 2 * jp, block_size, num_kv_heads, kvh, nb * 34);
        const uint8_t *b = 2 * jp + 1 < n ? cache_row(cache, table, j0 + 2 * jp + 1, block_size, num_kv_heads, kvh,
                                                      nb * 34) : zeros;
        for (int64_t blk = 0; blk < nb; blk++) {
            vd[blk * PF_KT + 2 * jp] = f16x1(a + blk * 34);
            vd[blk * PF_KT + 2 * jp + 1] = 2 * jp + 1 < n ? f16x1(b + blk * 34) : 0.0f;
            for (int e = 0; e < 2; e++)
                vdmax[blk] = vd[blk * PF_KT + 2 * jp + e] > vdmax[blk] ? vd[blk * PF_KT + 2 * jp + e] : vdmax[blk];
            pack_value_block(a, b, blk, v + jp * D * 2 + blk * 64);
        }
    }
}

/* Rows [0, rows) of the tile's scores -> probabilities (keys past a row's position get none; the
 * running max / sum move on and corr[r] is what the row's earlier output is scaled by), each times
 * the values' block scales and rounded to 16 bits: p[b][r][j] = round(e^(s_rj - m_r) vd[b][j] / ps[r][b])
 * with ps[r][b] = (the row's largest e^(s - m) in the tile) * vdmax[b] / 32767, a bound on the
 * products, so that one pass makes them. P V over a block of values is then a sum of 16-bit
 * products (exact in int32) times ps. Rounding to nearest. */
static void softmax_tile(Scratch *w, int64_t rows, int64_t G, int64_t nt, int64_t pos0, int64_t j0, int64_t n,
                         int64_t nb) {
    for (int64_t r = 0; r < rows; r++) {
        const float *s = w->s + r * PF_KT;
        const int64_t t = r / G < nt ? r / G : nt - 1; /* padded rows: as the last token */
        int64_t seen = pos0 + t - j0 + 1;
        seen = seen < n ? seen : n;
        if (seen <= 0) {
            for (int64_t b = 0; b < nb; b++) {
                memset(w->p + (b * rows + r) * PF_KT, 0, sizeof(int16_t) * PF_KT);
                w->ps[r * nb + b] = 0.0f;
            }
            w->corr[r] = 1.0f;
            continue;
        }
        const float m = row_max(s, seen);
        const float m_new = m > w->m[r] ? m : w->m[r], pmax = sexp(m - m_new);
        w->corr[r] = w->m[r] == -INFINITY ? 0.0f : sexp(w->m[r] - m_new);
        w->m[r] = m_new;
        for (int64_t b = 0; b < nb; b++) w->ps[r * nb + b] = pmax * w->vdmax[b] / 32767.0f;
        /* e^(s - m_new) vd / ps = e^(s - m) (vd 32767 / vdmax): the second factor is vdn */
        w->l[r] = w->l[r] * w->corr[r] + pmax * row_probs(s, seen, n, m, w->vdn, nb, w->p + r * PF_KT, rows * PF_KT);
    }
}

/* o[r] = o[r] * corr[r] + ps[r][b] * sum_j p[b][r][j] v[j] (b the block of the values), 4 rows by
 * 16 values at a time, the sums over token pairs in 16-bit multiply-adds. */
static void accumulate_tile(Scratch *w, int64_t rows, int64_t D, int64_t n) {
    const int64_t nb = D / 32, pairs = (n + 1) / 2;
    for (int64_t r0 = 0; r0 < rows; r0 += 4)
        for (int64_t d = 0; d < D; d += 16)
            pv_rows4(w->o + r0 * D + d, D, w->p + (d / 32 * rows + r0) * PF_KT, PF_KT, w->v + d * 2, D * 2, pairs,
                     w->corr + r0, w->ps + r0 * nb + d / 32, nb);
}

/* One item: tokens [t0, t0 + nt) of a sequence (q at its first), the G query heads of KV head kvh,
 * over keys [0, pos0 + nt) where pos0 is token t0's position. */
static void prefill_item(const float *q, int64_t q_stride, const uint8_t *k_cache, const uint8_t *v_cache,
                         const int32_t *table, int64_t pos0, int64_t nt, int64_t kvh, int64_t G, int64_t D,
                         int64_t num_kv_heads, int64_t block_size, float scale, float *out, Scratch *w) {
    const int64_t nb = D / 32, rows = (nt * G + 3) / 4 * 4, keys = pos0 + nt;
    round_rows(q, q_stride, nt, kvh * G, G, D, scale, rows, w->q, w->qd);
    for (int64_t r = 0; r < rows; r++) {
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    memset(w->o, 0, sizeof(float) * (size_t)(rows * D));
    for (int64_t j0 = 0; j0 < keys; j0 += PF_KT) {
        const int64_t n = keys - j0 < PF_KT ? keys - j0 : PF_KT;
        pack_keys(k_cache, table, j0, n, block_size, num_kv_heads, kvh, nb, w->k, w->kd);
        pack_values(v_cache, table, j0, n, block_size, num_kv_heads, kvh, nb, w->v, w->vd, w->vdmax);
        for (int64_t b = 0; b < nb; b++) {
            const float f = w->vdmax[b] > 0.0f ? 32767.0f / w->vdmax[b] : 0.0f;
            for (int64_t j = 0; j < PF_KT; j++) w->vdn[b * PF_KT + j] = j < n ? w->vd[b * PF_KT + j] * f : 0.0f;
        }
        for (int64_t r0 = 0; r0 < rows; r0 += 4)
            scores_rows4(w->q + r0 * 32, w->qd + r0 * nb, rows * 32, nb, w->k, w->kd, (n + 7) / 8, w->s + r0 * PF_KT, PF_KT);
        softmax_tile(w, rows, G, nt, pos0, j0, n, nb);
        accumulate_tile(w, rows, D, n);
    }
    for (int64_t r = 0; r < nt * G; r++) {
        const float inv = 1.0f / w->l[r];
        float *dst = out + (r / G) * q_stride + (kvh * G + r % G) * D;
        for (int64_t d = 0; d < D; d++) dst[d] = w->o[r * D + d] * inv;
    }
}

static int64_t tile_tokens(int64_t G) {
    const int64_t t = PF_ROWS / G;
    return t < 8 ? 8 : t;
}

/* A thread's buffers, carved out of one allocation (each part 64-byte aligned). */
static Scratch scratch_alloc(int64_t G, int64_t D) {
    const int64_t rows = (tile_tokens(G) * G + 3) / 4 * 4, nb = D / 32;
    /* bytes of q, qd, o, m / l / corr, s, k, kd, v, vd, vdn, p, ps */
    const size_t sizes[12] = {sizeof(int16_t) * rows * D, sizeof(float) * rows * nb, sizeof(float) * rows * D,
                              sizeof(float) * 3 * rows, sizeof(float) * rows * PF_KT, sizeof(int16_t) * PF_KT * D,
                              sizeof(float) * PF_KT * nb, sizeof(int16_t) * PF_KT * D, sizeof(float) * PF_KT * nb,
                              sizeof(float) * PF_KT * nb, sizeof(int16_t) * rows * nb * PF_KT, sizeof(float) * rows * nb};
    size_t offsets[12], total = 0;
    for (int i = 0; i < 12; i++) {
        offsets[i] = total;
        total += (sizes[i] + 63) / 64 * 64;
    }
    Scratch w;
    w.base = aligned_alloc(64, total);
    char *b = w.base;
    if (b == NULL) return w;
    w.q = (int16_t *)(b + offsets[0]);
    w.qd = (float *)(b + offsets[1]);
    w.o = (float *)(b + offsets[2]);
    w.m = (float *)(b + offsets[3]);
    w.l = w.m + rows;
    w.corr = w.m + 2 * rows;
    w.s = (float *)(b + offsets[4]);
    w.k = (int16_t *)(b + offsets[5]);
    w.kd = (float *)(b + offsets[6]);
    w.v = (int16_t *)(b + offsets[7]);
    w.vd = (float *)(b + offsets[8]);
    w.vdn = (float *)(b + offsets[9]);
    w.p = (int16_t *)(b + offsets[10]);
    w.ps = (float *)(b + offsets[11]);
    return w;
}

/* q_lens / k_lens [num_seqs]: each sequence's new tokens and all its tokens (k_len >= q_len, the new
 * ones last, already stored); block_tables [num_seqs, max_blocks]. Returns 0; 1 when a thread could
 * not allocate its buffers (out is then incomplete); 2 for a head_dim it does not take. */
int paged_prefill_attention_q8(const float *q, const uint8_t *k_cache, const uint8_t *v_cache,
                               const int32_t *block_tables, int64_t max_blocks, const int32_t *q_lens,
                               const int32_t *k_lens, int64_t num_seqs, float *out, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                               int num_threads) {
    if (head_dim % 32 != 0 || head_dim > PF_MAX_DIM || num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return 2;
    const int64_t G = num_heads / num_kv_heads, QT = tile_tokens(G), stride = num_heads * head_dim;
    int64_t items = 0;
    for (int64_t b = 0; b < num_seqs; b++) items += (q_lens[b] + QT - 1) / QT * num_kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        Scratch w = scratch_alloc(G, head_dim);
        const int ok = w.base != NULL;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        /* Item i: the sequences in turn, within one its tiles from the last (the most keys). */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            if (!ok) continue;
            int64_t rest = i, b = 0, q_start = 0;
            while (rest >= (q_lens[b] + QT - 1) / QT * num_kv_heads) {
                rest -= (q_lens[b] + QT - 1) / QT * num_kv_heads;
                q_start += q_lens[b++];
            }
            const int64_t tiles = (q_lens[b] + QT - 1) / QT, tile = tiles - 1 - rest / num_kv_heads;
            const int64_t kvh = rest % num_kv_heads, t0 = tile * QT;
            const int64_t nt = q_lens[b] - t0 < QT ? q_lens[b] - t0 : QT;
            const int64_t pos0 = k_lens[b] - q_lens[b] + t0;
            prefill_item(q + (q_start + t0) * stride, stride, k_cache, v_cache, block_tables + b * max_blocks, pos0,
                         nt, kvh, G, head_dim, num_kv_heads, block_size, scale, out + (q_start + t0) * stride, &w);
        }
        free(w.base);
    }
    return failed;
}
