/* Block-quantized weight formats (GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K), f16 and e4m3, as
 * rows of the weight-type table (cpu_kernels.c).
 *
 * A quantized matrix is held as the file stores it: n rows of k / block_size blocks each (the
 * block layouts are llama.cpp's, ggml-common.h). y = x W^T is computed in integers: every input row
 * is quantized once per call to 14-bit integers in groups (32 values for the 32-weight formats, 256
 * for the K-quants, one fp32 scale each, plus the sum of every 16 of them), held as two int8 planes
 * (see QuantRows), and each block's dot product is two integer sums of the weights with the planes
 * (AVX2 vpmaddubsw + vpmaddwd, or VNNI's vpdpbusd; Q8_0 without VNNI multiplies X itself, kept in
 * int16 too, by vpmaddwd), scaled
 * once per block (per 256 for the K-quants, whose 6-bit sub-block scales multiply in integers).
 * Offsets (Q4_0's -8, Q4_1's min, Q6_K's -32, Q4_K's mins) come out of the precomputed group sums,
 * not out of the weights, so the 4- and 6-bit values multiply as they are stored.
 *
 * Each weight row (or 8-row group of the interleaved layouts) is read once per call and multiplied
 * into up to QROWS input rows at a time (unpacked once for all of them); more input rows (prefill)
 * reread it from L1.
 * The AVX2 + FMA + F16C code is the baseline; each format also has a plain C version (other CPUs,
 * and the reference the tests compare the vector code with: same integer sums). */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QUANT_SIMD 1
#else
#define QUANT_SIMD 0
#endif

#include "cpu_kernels.h"

/* 256-bit integer dot products with accumulation (vpdpbusd): AVX512-VNNI or AVX-VNNI */
#if QUANT_SIMD && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
#define QUANT_VNNI 1
#else
#define QUANT_VNNI 0
#endif
/* The interleaved Q8_0 kernel multiplies X itself (int16) rather than its two int8 planes */
#define Q8_0_X16 (QUANT_SIMD && !QUANT_VNNI)
/* 512-bit vpdpbusd: the interleaved 32-weight formats multiply two 8-row groups at once (one row per
 * 32-bit lane of a zmm register), half the instructions per product of the 256-bit kernel, for
 * less than twice a ymm vpdpbusd's cost (docs/performance.md) */
#if QUANT_VNNI && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QUANT_VNNI512 1
#else
#define QUANT_VNNI512 0
#endif

#define QROWS 4 /* input rows multiplied per pass over a weight row */

static inline uint16_t read_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* IEEE half -> float (subnormals, infinities and NaNs included). */
#if QUANT_SIMD
static inline float f16_to_f32(uint16_t h) {
    return _cvtsh_ss(h);
}
#else
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    uint32_t u;
    if (exp == 0x1F) {
        u = sign | 0x7F800000u | (mant << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (mant << 13);
    } else {
        const float f = (float)mant * (1.0f / 16777216.0f); /* mant * 2^-24 */
        memcpy(&u, &f, sizeof u);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#endif

float nanovllm_f16_to_f32(uint16_t h) { return f16_to_f32(h); }

/* ---- input rows quantized to 14-bit integers, held as two int8 planes --------------------------
 * X = round(x / d) with d = max |x| / 127^2 per group, split as X = 127 hi + lo (|hi| <= 127,
 * |lo| <= 63): a dot product with X is 127 (w . hi) + (w . lo), two int8 dot products. One int8 plane
 * alone (llama.cpp's Q8 inputs) rounds an outlier channel's group so coarsely that a greedy answer
 * of a small model flips; the second plane brings the inputs' error to that of fp16. */
#define XMAX 16129 /* 127 * 127 */

/* Input rounding modes (Linear.input_planes): one plane everywhere (llama.cpp's int8), two
 * everywhere, or per group ("auto", the default): one plane where int8 rounding keeps the group's
 * noise 40 dB below its signal, two where it would not. Int8's noise is ~ group (max|x| / 127)^2 / 12
 * (uniform rounding error); the group is quiet when that is <= 1e-4 sum(x^2), i.e. its peak-to-rms
 * ratio is <= 4.4 (a group of gaussian values: ~2.5; a group holding an outlier channel: up to
 * sqrt(group)). On the default model 14% of the groups take two planes, and its perplexity and
 * answers are the two planes' (docs/performance.md item 34); the interleaved kernels skip the low
 * plane's products of the other groups. */
#define PLANES_AUTO 0
#define QUIET_RATIO2 (12.0f * 127.0f * 127.0f * 1e-4f) /* max|x|^2 group / sum(x^2) at the 40 dB floor */

typedef struct {
    const int8_t *hi, *lo; /* [rows][k] */
    const float *d;        /* [rows][k / group]: value = d X */
    const int32_t *sums;   /* [rows][k / 16]: sum of each 16 consecutive X */
    const int16_t *x16;    /* [rows][k]: X itself, or NULL (asked for by the Q8_0 kernel where Q8_0_X16) */
    const uint8_t *two;    /* [rows][k / group]: 0 where the group's lo is all zeros (X = 127 hi) */
    const float *dh;       /* [rows][k / group]: 127 d, the high plane's scale */
    const float *ds;       /* [rows][k / group]: d (sum of the group's X), the group's sum as a value */
    int64_t k, group;
} QuantRows;


/* Whether mode gives a group of max |x| amax and sum of squares ss both planes (PLANES_AUTO: unless
 * int8 alone keeps its noise at the 40 dB floor). */
static inline uint8_t two_planes(int mode, float amax, float ss, int64_t group) {
    return mode == 2 || (mode == PLANES_AUTO && !(amax * amax * (float)group <= QUIET_RATIO2 * ss));
}


/* One thread's buffer for the quantized rows, grown as needed and kept for its next calls. */
static _Thread_local void *quant_buffer;
static _Thread_local size_t quant_capacity;
/* From SHARED_ROWS input rows on (prefill, large batches) the team quantizes them once, each thread
 * its share, into one buffer they all read (below that, every thread quantizes every row itself:
 * a few thousand values, cheaper than the barrier). One team at a time uses it: every caller is a
 * parallel region's `omp for` over a matrix. */
#define SHARED_ROWS 16
static void *shared_buffer;
static size_t shared_capacity;
static int shared_failed;

/* Row r's per-group scales for the kernels that scale a group's two planes separately: 127 d (the
 * high plane's) and d S, S the group's X-sum (what a weight offset or min multiplies). */
static void group_scales(int64_t r, int64_t groups, int64_t group, const float *d, const int32_t *sums, float *dh,
                         float *ds) {
    for (int64_t g = 0; g < groups; g++) {
        int32_t s = 0;
        for (int64_t j = 0; j < group / 16; j++) s += sums[r * (groups * group / 16) + g * (group / 16) + j];
        dh[r * groups + g] = 127.0f * d[r * groups + g];
        ds[r * groups + g] = d[r * groups + g] * (float)s;
    }
}

/* The bodies by instruction set: the plain C reference is always compiled (the build of CPUs without
 * AVX2, and the oracle quantize_row_matches_reference checks the vector body against); the AVX2 +
 * FMA + F16C one where the CPU has them. */
#include "cpu_quant_ref.h"
#if QUANT_SIMD
#include "cpu_quant_avx2.h"
#define quantize_row quantize_row_avx2
#else
#define quantize_row quantize_row_ref
#endif

/* 1 when this build's quantize_row gives the reference's integers, scales and flags for the row x
 * of k values (groups of `group`, rounding mode `mode`); 0 otherwise, -1 without memory. */
int64_t quantize_row_matches_reference(const float *x, int64_t k, int64_t group, int mode) {
    const int64_t groups = k / group, sixteens = k / 16;
    const size_t bytes = 2 * (2 * (size_t)k + sizeof(float) * (size_t)groups + (size_t)groups +
                              sizeof(int32_t) * (size_t)sixteens);
    int8_t *mine = calloc(1, bytes), *ref = calloc(1, bytes);
    if (mine == NULL || ref == NULL) {
        free(mine);
        free(ref);
        return -1;
    }
    int8_t *out[2] = {mine, ref};
    for (int which = 0; which < 2; which++) {
        int8_t *hi = out[which], *lo = hi + k;
        float *d = (float *)(lo + k);
        uint8_t *two = (uint8_t *)(d + groups);
        int32_t *sums = (int32_t *)(two + groups); /* (unaligned is fine on x86; memcpy'd compare) */
        if (which == 0)
            quantize_row(x, k, group, mode, hi, lo, NULL, d, two, sums);
        else
            quantize_row_ref(x, k, group, mode, hi, lo, NULL, d, two, sums);
    }
    const int64_t same = memcmp(mine, ref, bytes) == 0;
    free(mine);
    free(ref);
    return same;
}

/* x [rows, k] (row stride ldx) quantized in groups of `group` values (k a multiple of group and
 * of 16); with_x16 (vector builds only) also keeps X in int16. mode (PLANES_AUTO, 1 or 2): a group
 * of one plane has each value rounded to an int8 hi = round(127 x / max|x|) (llama.cpp's Q8 inputs)
 * and lo = 0, a two-plane input like any other (X = 127 hi, the same scale d), so every kernel takes
 * it; the interleaved ones skip the low plane's products where q->two says 0. Returns 0, or 1 when
 * the buffer cannot be had. */
static int quantize_rows(const float *x, int64_t ldx, int64_t rows, int64_t k, int64_t group, int with_x16,
                         int mode, QuantRows *q) {
    const int64_t groups = k / group, sixteens = k / 16;
    with_x16 = with_x16 && QUANT_SIMD;
    const size_t need = (size_t)rows * ((with_x16 ? 4 : 2) * (size_t)k + 3 * sizeof(float) * (size_t)groups +
                                        sizeof(int32_t) * (size_t)sixteens + (size_t)groups) + 64;
    const int shared = rows >= SHARED_ROWS && omp_in_parallel() && omp_get_num_threads() > 1;
    void *buffer;
    int64_t r0 = 0, r1 = rows; /* the rows this thread quantizes */
    if (shared) {
        /* every thread is done reading the last matrix's rows (the row loops end without a barrier)
         * before the buffer is grown or rewritten */
#pragma omp barrier
#pragma omp single
        {
            shared_failed = 0;
            if (need > shared_capacity) {
                void *grown = realloc(shared_buffer, need);
                if (grown == NULL)
                    shared_failed = 1;
                else
                    shared_buffer = grown, shared_capacity = need;
            }
        }
        if (shared_failed) return 1;
        buffer = shared_buffer;
        const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
        r0 = rows * t / threads, r1 = rows * (t + 1) / threads;
    } else {
        if (need > quant_capacity) {
            void *grown = realloc(quant_buffer, need);
            if (grown == NULL) return 1;
            quant_buffer = grown, quant_capacity = need;
        }
        buffer = quant_buffer;
    }
    float *d = buffer;
    int32_t *sums = (int32_t *)(d + rows * groups);
    int16_t *x16 = with_x16 ? (int16_t *)(sums + rows * sixteens) : NULL;
    int8_t *hi = (int8_t *)(sums + rows * sixteens) + (with_x16 ? 2 * rows * k : 0), *lo = hi + rows * k;
    uint8_t *two = (uint8_t *)(lo + rows * k);
    float *dh = (float *)(((uintptr_t)(two + rows * groups) + 3) & ~(uintptr_t)3), *ds = dh + rows * groups;
    for (int64_t r = r0; r < r1; r++) {
        quantize_row(x + r * ldx, k, group, mode, hi + r * k, lo + r * k, with_x16 ? x16 + r * k : NULL,
                     d + r * groups, two + r * groups, sums + r * sixteens);
        group_scales(r, groups, group, d, sums, dh, ds);
    }
    if (shared) {
#pragma omp barrier
    }
    *q = (QuantRows){hi, lo, d, sums, x16, two, dh, ds, k, group};
    return 0;
}

/* X of input value j of a row (plain C paths). */
static inline int32_t x_at(const int8_t *hi, const int8_t *lo, int64_t j) { return 127 * hi[j] + lo[j]; }

/* ---- vector helpers --------------------------------------------------------------------------- */
#if QUANT_SIMD
/* 8 int32 sums of u (unsigned bytes) x s (signed bytes), 4 products each. NOTE: vpmaddubsw
 * saturates a pair's sum at int16: every caller keeps |u| * |s| * 2 <= 128 * 127 * 2. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
static inline __m256i dot_us(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
#elif defined(__AVXVNNI__)
static inline __m256i dot_us(__m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s); }
#else
static inline __m256i dot_us(__m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }
#endif

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256i load_i8(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 16 bytes of packed nibbles as 32 bytes: the low nibbles first, then the high ones (the order
 * of values in Q4_0 / Q4_1 / Q5_* blocks). */
static inline __m256i nibbles_32(const uint8_t *p) {
    const __m128i t = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}

/* Byte j = 0x10 where bit j of the 32 bits at p is set, else 0 (Q5's fifth bits). */
static inline __m256i fifth_bits_32(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, sizeof bits);
    /* byte j of sel is byte j / 8 of bits; the mask picks bit j % 8 of it */
    const __m256i sel = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                            _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                                               0x0303030303030303LL));
    const __m256i mask = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(sel, mask), mask), _mm256_set1_epi8(0x10));
}
#endif

/* ---- the 32-weight formats -----------------------------------------------------------------------
 * Each block: an fp16 scale d (and for Q4_1 / Q5_1 an fp16 min m), then the values:
 *   Q8_0 (34 bytes): int8 q[32];                          w = d q
 *   Q4_0 (18): nibbles[16] (low: values 0-15, high: 16-31); w = d (q - 8)
 *   Q4_1 (20): d, m, nibbles[16];                         w = d q + m
 *   Q5_0 (22): d, fifth bits[4], nibbles[16];              w = d (q - 16)
 *   Q5_1 (24): d, m, fifth bits[4], nibbles[16];           w = d q + m
 * The dot of a block with an input group (scale dx, values x, sum S) is
 *   d dx (sum q x) - offset d dx S   or   d dx (sum q x) + m dx S. */
typedef enum { FMT_Q8_0, FMT_Q4_0, FMT_Q4_1, FMT_Q5_0, FMT_Q5_1 } Fmt32;

/* Per Fmt32 (constant-folded where f is a constant): bytes per block, whether it has a min, the
 * offset its stored values carry, its name in the table. */
static const int FMT32_BYTES[] = {34, 18, 20, 22, 24}, FMT32_MIN[] = {0, 0, 1, 0, 1}, FMT32_OFFSET[] = {0, 8, 0, 16, 0};
static const char *const FMT32_NAMES[] = {"q8_0", "q4_0", "q4_1", "q5_0", "q5_1"};
static inline int fmt_bytes(Fmt32 f) { return FMT32_BYTES[f]; }
static inline int fmt_has_min(Fmt32 f) { return FMT32_MIN[f]; }
static inline int fmt_offset(Fmt32 f) { return FMT32_OFFSET[f]; }

/* The Fmt32 of a format's name, or -1. */
static int fmt32_of(const char *name) {
    for (int f = 0; f < (int)(sizeof FMT32_NAMES / sizeof FMT32_NAMES[0]); f++)
        if (strcmp(name, FMT32_NAMES[f]) == 0) return f;
    return -1;
}

/* The 32 stored (unsigned, for Q8_0 signed) values of a block, in order. */
static inline void block32_values(Fmt32 f, const uint8_t *blk, int32_t q[32]) {
    if (f == FMT_Q8_0) {
        for (int j = 0; j < 32; j++) q[j] = (int8_t)blk[2 + j];
        return;
    }
    const int head = f == FMT_Q4_0 ? 2 : f == FMT_Q4_1 ? 4 : f == FMT_Q5_0 ? 6 : 8;
    const uint8_t *nib = blk + head;
    uint32_t bits = 0;
    if (f == FMT_Q5_0 || f == FMT_Q5_1) memcpy(&bits, blk + head - 4, sizeof bits);
    for (int j = 0; j < 16; j++) {
        q[j] = (nib[j] & 0x0F) | (int32_t)(((bits >> j) & 1) << 4);
        q[j + 16] = (nib[j] >> 4) | (int32_t)(((bits >> (j + 16)) & 1) << 4);
    }
}

/* out[b] = row w . input row b0 + b, for b < NB. */
/* Per-row pointers into the quantized inputs of rows b0 .. b0 + NB (hoisted out of the block loops:
 * the divisions behind them cost more than a block's dot product). */
typedef struct {
    const int8_t *hi[QROWS], *lo[QROWS];
    const float *d[QROWS], *dh[QROWS], *ds[QROWS];
    const int32_t *sums[QROWS];
    const int16_t *x16[QROWS];
    const uint8_t *two[QROWS];
} InputRows;

static inline __attribute__((always_inline)) InputRows input_rows(const QuantRows *q, int64_t b0, const int NB) {
    InputRows in;
    const int64_t groups = q->k / q->group, sixteens = q->k / 16;
    for (int b = 0; b < NB; b++) {
        in.hi[b] = q->hi + (b0 + b) * q->k;
        in.lo[b] = q->lo + (b0 + b) * q->k;
        in.d[b] = q->d + (b0 + b) * groups;
        in.sums[b] = q->sums + (b0 + b) * sixteens;
        in.x16[b] = q->x16 != NULL ? q->x16 + (b0 + b) * q->k : NULL;
        in.two[b] = q->two + (b0 + b) * groups;
        in.dh[b] = q->dh + (b0 + b) * groups;
        in.ds[b] = q->ds + (b0 + b) * groups;
    }
    return in;
}

/* out[b] = row w . input row b0 + b, for b < NB. */
#if QUANT_SIMD
static inline __attribute__((always_inline)) void dot_fmt32(Fmt32 f, const uint8_t *w, const QuantRows *q, int64_t b0,
                                                           const int NB, float *out) {
    const int64_t blocks = q->k / 32, bytes = fmt_bytes(f);
    const InputRows in = input_rows(q, b0, NB);
    float corr[QROWS] = {0};
    /* Two sums per row (even and odd blocks), so consecutive blocks' FMAs do not wait on each other. */
    __m256 acc[2][QROWS];
    for (int b = 0; b < NB; b++) acc[0][b] = acc[1][b] = _mm256_setzero_ps();
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *blk = w + i * bytes;
        const float d = f16_to_f32(read_u16(blk));
        const float m = fmt_has_min(f) ? f16_to_f32(read_u16(blk + 2)) : 0.0f;
        __m256i wv = _mm256_setzero_si256(), aw;
        if (f == FMT_Q8_0) {
            wv = load_i8(blk + 2);
            aw = _mm256_sign_epi8(wv, wv); /* |w| as unsigned; the sign moves onto x */
        } else if (f == FMT_Q4_0 || f == FMT_Q4_1) {
            aw = nibbles_32(blk + (f == FMT_Q4_0 ? 2 : 4));
        } else {
            const uint8_t *qh = blk + (f == FMT_Q5_0 ? 2 : 4);
            aw = _mm256_or_si256(nibbles_32(qh + 4), fifth_bits_32(qh));
        }
        for (int b = 0; b < NB; b++) {
            const __m256i xh = load_i8(in.hi[b] + i * 32), xl = load_i8(in.lo[b] + i * 32);
            const float dx = in.d[b][i];
            __m256i p = f == FMT_Q8_0 ? planes(dot_us(aw, _mm256_sign_epi8(xh, wv)), dot_us(aw, _mm256_sign_epi8(xl, wv)))
                                      : planes(dot_us(aw, xh), dot_us(aw, xl));
            const int32_t s32 = in.sums[b][2 * i] + in.sums[b][2 * i + 1];
            if (fmt_offset(f)) /* sum (q - off) x = sum q x - off S: off / 8 * S off each of the 8 lanes */
                p = _mm256_sub_epi32(p, _mm256_set1_epi32(fmt_offset(f) / 8 * s32));
            acc[i & 1][b] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(p), acc[i & 1][b]);
            if (fmt_has_min(f)) corr[b] += m * dx * (float)s32;
        }
    }
    for (int b = 0; b < NB; b++) out[b] = hsum_ps(_mm256_add_ps(acc[0][b], acc[1][b])) + corr[b];
}
#else
static inline __attribute__((always_inline)) void dot_fmt32(Fmt32 f, const uint8_t *w, const QuantRows *q, int64_t b0,
                                                           const int NB, float *out) {
    const int64_t blocks = q->k / 32, bytes = fmt_bytes(f);
    const InputRows in = input_rows(q, b0, NB);
    float corr[QROWS] = {0};
    float acc[QROWS] = {0};
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *blk = w + i * bytes;
        const float d = f16_to_f32(read_u16(blk));
        const float m = fmt_has_min(f) ? f16_to_f32(read_u16(blk + 2)) : 0.0f;
        int32_t v[32];
        block32_values(f, blk, v);
        for (int b = 0; b < NB; b++) {
            int32_t sum = 0;
            for (int j = 0; j < 32; j++) sum += v[j] * x_at(in.hi[b], in.lo[b], i * 32 + j);
            const float dx = in.d[b][i];
            const int32_t s32 = in.sums[b][2 * i] + in.sums[b][2 * i + 1];
            acc[b] += d * dx * (float)(sum - fmt_offset(f) * s32);
            if (fmt_has_min(f)) corr[b] += m * dx * (float)s32;
        }
    }
    for (int b = 0; b < NB; b++) out[b] = acc[b] + corr[b];
}
#endif

static void to_f32_fmt32(Fmt32 f, const Linear *m, int64_t r, float *out) {
    const uint8_t *row = (const uint8_t *)m->data + r * m->row_bytes;
    for (int64_t i = 0; i < m->k / 32; i++) {
        const uint8_t *blk = row + i * fmt_bytes(f);
        const float d = f16_to_f32(read_u16(blk)), mn = fmt_has_min(f) ? f16_to_f32(read_u16(blk + 2)) : 0.0f;
        int32_t v[32];
        block32_values(f, blk, v);
        for (int j = 0; j < 32; j++) out[i * 32 + j] = d * (float)(v[j] - fmt_offset(f)) + mn;
    }
}

/* ---- the 32-weight formats interleaved by 8 rows ------------------------------------------------
 * Repacked at load (repack_x8, same bytes as the plain rows): per group of 8 rows and per block, the
 * 8 rows' fp16 scales (and mins) side by side, then their values in 4-byte chunks, chunk c of row r
 * at byte 32 c + 4 r. One 32-byte load then holds chunk c of all 8 rows, and each 32-bit lane of an
 * integer dot with a broadcast input chunk accumulates one row's sum: the products of 8 rows come
 * out as one vector, with no horizontal sums, and the scales multiply 8 rows at a time.
 *   q8_0x8 (272 bytes): d[8], then 8 chunks of values 4c..4c+3
 *   q4_0x8 (144): d[8], then 4 chunks of the stored nibble bytes 4c..4c+3 (low nibbles: values
 *          4c..4c+3, high: 16 + 4c..)                            q4_1x8 (160): d[8], m[8], nibbles
 *   q5_0x8 (176): d[8], fifth bits[8] (a 32-bit word per row, bit 8 t + c: value 4 c + t), nibbles
 *   q5_1x8 (192): d[8], m[8], fifth bits[8], nibbles */
#define IL 8

static inline int fmt_scales_bytes(Fmt32 f) { return fmt_has_min(f) ? 4 * IL : 2 * IL; }

/* Copy row `lane`'s block between the plain layout (plain) and a group's interleaved block (x8):
 * to_x8 1 repacks, 0 unpacks. */
static void x8_block(Fmt32 f, int to_x8, uint8_t *plain, uint8_t *x8, int lane) {
    const int heads = fmt_has_min(f) ? 4 : 2;
    for (int h = 0; h < heads; h += 2) { /* d (and m) */
        uint8_t *a = plain + h, *b = x8 + h * IL + 2 * lane;
        memcpy(to_x8 ? b : a, to_x8 ? a : b, 2);
    }
    uint8_t *values = x8 + fmt_scales_bytes(f);
    if (f == FMT_Q8_0) {
        for (int c = 0; c < 8; c++) memcpy(to_x8 ? values + 32 * c + 4 * lane : plain + 2 + 4 * c,
                                           to_x8 ? plain + 2 + 4 * c : values + 32 * c + 4 * lane, 4);
        return;
    }
    const int five = f == FMT_Q5_0 || f == FMT_Q5_1;
    uint8_t *nib = plain + heads + (five ? 4 : 0);
    if (five) {
        uint8_t *word = values + 4 * lane;
        values += 4 * IL;
        uint32_t bits = 0, moved = 0;
        if (to_x8) {
            memcpy(&bits, plain + heads, 4);
            for (int c = 0; c < 8; c++)
                for (int t = 0; t < 4; t++) moved |= ((bits >> (4 * c + t)) & 1u) << (8 * t + c);
            memcpy(word, &moved, 4);
        } else {
            memcpy(&moved, word, 4);
            for (int c = 0; c < 8; c++)
                for (int t = 0; t < 4; t++) bits |= ((moved >> (8 * t + c)) & 1u) << (4 * c + t);
            memcpy(plain + heads, &bits, 4);
        }
    }
    for (int c = 0; c < 4; c++) memcpy(to_x8 ? values + 32 * c + 4 * lane : nib + 4 * c,
                                       to_x8 ? nib + 4 * c : values + 32 * c + 4 * lane, 4);
}

/* quantize_rows' mode for m's inputs: Linear.input_planes 1 or 2, anything else PLANES_AUTO. */
static inline int input_mode(const Linear *m) { return m->input_planes == 1 || m->input_planes == 2 ? (int)m->input_planes : PLANES_AUTO; }

static inline const uint8_t *group_of(const Linear *m, int64_t g) {
    return (const uint8_t *)m->data + g * IL * m->row_bytes;
}

static void to_f32_fmt32x8(Fmt32 f, const Linear *m, int64_t r, float *out) {
    const uint8_t *grp = group_of(m, r / IL);
    const int64_t bytes = fmt_bytes(f);
    uint8_t plain[40]; /* the largest plain block: Q8_0, 34 bytes */
    Linear one = *m;
    one.data = plain, one.n = 1, one.k = 32, one.row_bytes = bytes, one.next = NULL;
    for (int64_t i = 0; i < m->k / 32; i++) {
        x8_block(f, 0, plain, (uint8_t *)grp + i * IL * bytes, (int)(r % IL));
        to_f32_fmt32(f, &one, 0, out + 32 * i);
    }
}

#if QUANT_SIMD
/* acc + dot_us(u, s) */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
static inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
static inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
static inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Units 2c and 2c + 1 (c = 0..3) of an interleaved 32-weight block whose values start at `values`:
 * each the 8 rows' 4 values that one broadcast 4-value input chunk multiplies, as unsigned bytes.
 * 4/5-bit: the low and the high nibbles (values 4c.. and 16 + 4c..), with their fifth bits; Q8_0
 * (VNNI only: vpdpbusd does not saturate): chunks 2c and 2c + 1 plus 128 (values 8c.., 8c + 4..).
 * *xa, *xb: where their input chunks start in the block. */
static inline __attribute__((always_inline)) void units_x8(Fmt32 f, const uint8_t *values, int c, __m256i *a,
                                                          __m256i *b, int *xa, int *xb) {
    if (f == FMT_Q8_0) {
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        *a = _mm256_xor_si256(load_i8(values + 64 * c), flip), *b = _mm256_xor_si256(load_i8(values + 64 * c + 32), flip);
        *xa = 8 * c, *xb = 8 * c + 4;
        return;
    }
    const int five = f == FMT_Q5_0 || f == FMT_Q5_1;
    const __m256i m4 = _mm256_set1_epi8(0x0F), v = load_i8(values + (five ? 4 * IL : 0) + 32 * c);
    *a = _mm256_and_si256(v, m4), *b = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (five) {
        const __m256i hbits = load_i8(values), one = _mm256_set1_epi32(0x01010101);
        *a = _mm256_or_si256(*a, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hbits, c), one), 4));
        *b = _mm256_or_si256(*b, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hbits, c + 4), one), 4));
    }
    *xa = 4 * c, *xb = 16 + 4 * c;
}

/* What the unsigned units hold above the weights' values (Q4_0's 8, Q5_0's 16, Q8_0's 128). */
static inline int units_offset(Fmt32 f) { return f == FMT_Q8_0 ? 128 : fmt_offset(f); }

/* Bit j: flag j of two[0 .. n) (n <= 32) is set. Reads 32 bytes whatever n: quantize_rows' buffer
 * holds the scales' arrays (and 64 spare bytes) after the flags. */
static inline uint32_t flag_bits(const uint8_t *two, int64_t n) {
    const uint32_t bits = ~(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(load_i8(two), _mm256_setzero_si256()));
    return n < 32 ? bits & ((1u << n) - 1) : bits;
}

/* Bit j: block i0 + j (of i0 .. i0 + n, n <= 32) takes the low plane's products in some row b < NB. */
static inline __attribute__((always_inline)) uint32_t loud_blocks(const InputRows *in, int64_t i0, int64_t n, const int NB) {
    uint32_t bits = 0;
    for (int b = 0; b < NB; b++) bits |= flag_bits(in->two[b] + i0, n);
    return bits;
}

/* sum[b] (b < NB; lane r: row r of the group) = the integer products of one block's units (values at
 * `values`) with 32 values of an input plane at x[b] (without VNNI: vpmaddubsw pair sums added in
 * int16, <= 8 x 2 x 15 x 127 = 30,480 for 4-bit weights, 4 of 2 x 31 x 127 for 5-bit). */
#if QUANT_VNNI
static inline __attribute__((always_inline)) void block_units_x8(Fmt32 f, const uint8_t *values, const int8_t *x[QROWS],
                                                                const int NB, __m256i sum[QROWS]) {
    const int five = f == FMT_Q5_0 || f == FMT_Q5_1;
    for (int b = 0; b < NB; b++) sum[b] = _mm256_setzero_si256();
    /* unit pairs 0..3 in runs of `run` (without VNNI: as many as the int16 sums hold) */
    const int run = QUANT_VNNI || !five ? 4 : 2;
    for (int c0 = 0; c0 < 4; c0 += run) {
        /* NOTE: unrolled, GCC unpacked all units first and spilled them (16 ymm registers) */
#pragma GCC unroll 1
        for (int c = c0; c < c0 + run; c++) {
            __m256i ua, ub;
            int xa, xb;
            units_x8(f, values, c, &ua, &ub, &xa, &xb);
            for (int b = 0; b < NB; b++) {
                sum[b] = dot_acc(dot_acc(sum[b], ua, bcast4(x[b] + xa)), ub, bcast4(x[b] + xb));
            }
        }
    }
}
#else
static inline __attribute__((always_inline)) void block_units_x8(Fmt32 f, const uint8_t *values, const int8_t *x[QROWS],
                                                                const int NB, __m256i sum[QROWS]) {
    const int five = f == FMT_Q5_0 || f == FMT_Q5_1;
    for (int b = 0; b < NB; b++) sum[b] = _mm256_setzero_si256();
    /* unit pairs 0..3 in runs of `run` (without VNNI: as many as the int16 sums hold) */
    const int run = QUANT_VNNI || !five ? 4 : 2;
    for (int c0 = 0; c0 < 4; c0 += run) {
        __m256i t[QROWS];
        for (int b = 0; b < NB; b++) t[b] = _mm256_setzero_si256();
        /* NOTE: unrolled, GCC unpacked all units first and spilled them (16 ymm registers) */
#pragma GCC unroll 1
        for (int c = c0; c < c0 + run; c++) {
            __m256i ua, ub;
            int xa, xb;
            units_x8(f, values, c, &ua, &ub, &xa, &xb);
            for (int b = 0; b < NB; b++) {
                t[b] = _mm256_add_epi16(t[b], _mm256_add_epi16(_mm256_maddubs_epi16(ua, bcast4(x[b] + xa)),
                                                               _mm256_maddubs_epi16(ub, bcast4(x[b] + xb))));
            }
        }
        for (int b = 0; b < NB; b++) sum[b] = _mm256_add_epi32(sum[b], _mm256_madd_epi16(t[b], _mm256_set1_epi16(1)));
    }
}
#endif

/* The interleaved 32-weight tile (4/5-bit formats; Q8_0 with VNNI): out[b][r] = row 8 g + r . input
 * row b0 + b, b < NB. Per block the high plane's products of every row, scaled by the input's
 * precomputed 127 d, and the weights' offset or min against the input's d S. The low plane's
 * products come after the blocks, for the blocks loud in any of the NB rows (a quiet row's low
 * plane there is zeros): no branch in the block loop, and the unpacked units of a block serve all
 * NB rows in both passes (an outlier channel makes the same groups loud in most rows).
 * performance.md item 37. */
static inline __attribute__((always_inline)) void dot_units32x8(Fmt32 f, const uint8_t *grp, const QuantRows *q,
                                                               int64_t b0, const int NB, const int P,
                                                               float out[QROWS][IL]) {
    const int64_t blocks = q->k / 32, bytes = IL * fmt_bytes(f), vo = fmt_scales_bytes(f);
    const InputRows in = input_rows(q, b0, NB);
    __m256 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *blk = grp + i * bytes;
        const int8_t *x[QROWS];
        for (int b = 0; b < NB; b++) x[b] = in.hi[b] + 32 * i;
        __m256i sum[QROWS];
        block_units_x8(f, blk + vo, x, NB, sum);
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 e8 = fmt_has_min(f) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 2 * IL)))
                                         : _mm256_mul_ps(d8, _mm256_set1_ps(-(float)units_offset(f)));
        for (int b = 0; b < NB; b++) {
            acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(in.dh[b][i])), _mm256_cvtepi32_ps(sum[b]), acc[b]);
            acc[b] = _mm256_fmadd_ps(e8, _mm256_set1_ps(in.ds[b][i]), acc[b]);
        }
    }
    if (P == 2)
        for (int64_t i0 = 0; i0 < blocks; i0 += 32)
            for (uint32_t bits = loud_blocks(&in, i0, blocks - i0 < 32 ? blocks - i0 : 32, NB); bits; bits &= bits - 1) {
                const int64_t i = i0 + __builtin_ctz(bits);
                const uint8_t *blk = grp + i * bytes;
                const int8_t *x[QROWS];
                for (int b = 0; b < NB; b++) x[b] = in.lo[b] + 32 * i;
                __m256i sum[QROWS]; /* (int16 runs: the low plane's 2 x 31 x 63 pair sums are smaller) */
                block_units_x8(f, blk + vo, x, NB, sum);
                const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
                for (int b = 0; b < NB; b++)
                    acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(in.d[b][i])), _mm256_cvtepi32_ps(sum[b]), acc[b]);
            }
    for (int b = 0; b < NB; b++) _mm256_storeu_ps(out[b], acc[b]);
}
#endif

/* acc[b] (lane r: weight row 8 g + r) += group g . input row b0 + b, b < NB. */
/* P: the input's planes (1: its low plane is zero, and its products are skipped). */
#if QUANT_SIMD
static inline __attribute__((always_inline)) void dot_fmt32x8(Fmt32 f, const uint8_t *grp, const QuantRows *q,
                                                             int64_t b0, const int NB, const int P,
                                                             float out[QROWS][IL]) {
    const int64_t blocks = q->k / 32, bytes = IL * fmt_bytes(f);
    const InputRows in = input_rows(q, b0, NB);
    if (QUANT_VNNI || f != FMT_Q8_0) {
        dot_units32x8(f, grp, q, b0, NB, P, out);
        return;
    }
    /* Q8_0 without VNNI: the weights widened to int16 (once for all NB rows) and multiplied with X
     * itself by vpmaddwd, 16 products per instruction (vpmaddubsw would saturate on Q8_0's range).
     * Lane pairs of w03 hold rows 0-3 (values 4c..4c+1 and 4c+2..4c+3), of w47 rows 4-7;
     * |sum| <= 32 x 128 x 16129 < 2^31. */
    __m256 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *blk = grp + i * bytes, *values = blk + fmt_scales_bytes(f);
        __m256i s03[QROWS], s47[QROWS];
        for (int b = 0; b < NB; b++) s03[b] = s47[b] = _mm256_setzero_si256();
        /* NOTE: fully unrolled, GCC computed all 8 chunks' products before summing any and kept them
         * on the stack (the AVX2 build has 16 vector registers), much slower (docs/performance.md) */
#pragma GCC unroll 4
        for (int c = 0; c < 8; c++) {
            const __m256i w03 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(values + 32 * c)));
            const __m256i w47 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(values + 32 * c + 16)));
            for (int b = 0; b < NB; b++) {
                long long x4;
                memcpy(&x4, in.x16[b] + i * 32 + 4 * c, sizeof x4);
                const __m256i xv = _mm256_set1_epi64x(x4);
                s03[b] = _mm256_add_epi32(s03[b], _mm256_madd_epi16(w03, xv));
                s47[b] = _mm256_add_epi32(s47[b], _mm256_madd_epi16(w47, xv));
            }
        }
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        for (int b = 0; b < NB; b++) {
            /* pair sums to rows: hadd gives rows 0 1 4 5 | 2 3 6 7, the permute puts them in order */
            const __m256i sum = _mm256_permute4x64_epi64(_mm256_hadd_epi32(s03[b], s47[b]), 0xD8);
            acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(in.d[b][i])), _mm256_cvtepi32_ps(sum), acc[b]);
        }
    }
    for (int b = 0; b < NB; b++) _mm256_storeu_ps(out[b], acc[b]);
}
#else
static inline __attribute__((always_inline)) void dot_fmt32x8(Fmt32 f, const uint8_t *grp, const QuantRows *q,
                                                             int64_t b0, const int NB, const int P,
                                                             float out[QROWS][IL]) {
    const int64_t blocks = q->k / 32, bytes = IL * fmt_bytes(f);
    const InputRows in = input_rows(q, b0, NB);
    /* Plain C: each row's block unpacked to the plain layout, then dot_fmt32's arithmetic. */
    (void)P;
    for (int b = 0; b < NB; b++)
        for (int r = 0; r < IL; r++) out[b][r] = 0.0f;
    for (int64_t i = 0; i < blocks; i++) {
        for (int r = 0; r < IL; r++) {
            uint8_t plain[40]; /* the largest plain block: Q8_0, 34 bytes */
            x8_block(f, 0, plain, (uint8_t *)grp + i * bytes, r);
            const float d = f16_to_f32(read_u16(plain));
            const float m = fmt_has_min(f) ? f16_to_f32(read_u16(plain + 2)) : 0.0f;
            int32_t v[32];
            block32_values(f, plain, v);
            for (int b = 0; b < NB; b++) {
                int32_t sum = 0;
                for (int j = 0; j < 32; j++) sum += v[j] * x_at(in.hi[b], in.lo[b], i * 32 + j);
                const int32_t s32 = in.sums[b][2 * i] + in.sums[b][2 * i + 1];
                out[b][r] += d * in.d[b][i] * (float)(sum - fmt_offset(f) * s32) + m * in.d[b][i] * (float)s32;
            }
        }
    }
}
#endif

#if QUANT_VNNI512
static inline __m512i bcast4x16(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* The 32 bytes at a (group g's) and b (group g + 1's) as one zmm: lanes 0-7 rows 8 g.., 8-15 the next 8. */
static inline __m512i load_pair(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(load_i8(a)), load_i8(b), 1);
}

/* The 8 fp16 at a and 8 at b as 16 floats (a's first). */
static inline __m512 halfs_x16(const uint8_t *a, const uint8_t *b) {
    return _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128((const __m128i *)b), _mm_loadu_si128((const __m128i *)a)));
}

/* units_x8 for two 8-row groups at once: their blocks' values at a and b, lanes 0-7 group a's rows. */
static inline __attribute__((always_inline)) void units_x16(Fmt32 f, const uint8_t *a, const uint8_t *b, int c,
                                                           __m512i *ua, __m512i *ub, int *xa, int *xb) {
    if (f == FMT_Q8_0) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        *ua = _mm512_xor_si512(load_pair(a + 64 * c, b + 64 * c), flip);
        *ub = _mm512_xor_si512(load_pair(a + 64 * c + 32, b + 64 * c + 32), flip);
        *xa = 8 * c, *xb = 8 * c + 4;
        return;
    }
    const int five = f == FMT_Q5_0 || f == FMT_Q5_1, no = five ? 4 * IL : 0;
    const __m512i m4 = _mm512_set1_epi8(0x0F), v = load_pair(a + no + 32 * c, b + no + 32 * c);
    *ua = _mm512_and_si512(v, m4), *ub = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    if (five) {
        const __m512i hbits = load_pair(a, b), one = _mm512_set1_epi32(0x01010101);
        *ua = _mm512_or_si512(*ua, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hbits, c), one), 4));
        *ub = _mm512_or_si512(*ub, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hbits, c + 4), one), 4));
    }
    *xa = 4 * c, *xb = 16 + 4 * c;
}

/* block_units_x8 on two 8-row groups' blocks (values at a and b) at once. */
static inline __attribute__((always_inline)) void block_units_x16(Fmt32 f, const uint8_t *va, const uint8_t *vb,
                                                                 const int8_t *x[QROWS], const int NB, __m512i sum[QROWS]) {
    for (int b = 0; b < NB; b++) sum[b] = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        __m512i ua, ub;
        int xa, xb;
        units_x16(f, va, vb, c, &ua, &ub, &xa, &xb);
        for (int b = 0; b < NB; b++)
            sum[b] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum[b], ua, bcast4x16(x[b] + xa)), ub, bcast4x16(x[b] + xb));
    }
}

/* out[b][r] = row 16 h + r . input row b0 + b (r < 16, b < NB), rows 16 h .. 16 h + 16 being the 8-row
 * groups at grp (2 h) and grp + group_bytes (2 h + 1): dot_units32x8's arithmetic on both at once. */
static inline __attribute__((always_inline)) void dot_units32x16(Fmt32 f, const uint8_t *grp, int64_t group_bytes,
                                                                const QuantRows *q, int64_t b0, const int NB,
                                                                const int P, float out[QROWS][2 * IL]) {
    const int64_t blocks = q->k / 32, bytes = IL * fmt_bytes(f), vo = fmt_scales_bytes(f);
    const InputRows in = input_rows(q, b0, NB);
    __m512 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm512_setzero_ps();
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *ba = grp + i * bytes, *bb = ba + group_bytes;
        const int8_t *x[QROWS];
        for (int b = 0; b < NB; b++) x[b] = in.hi[b] + 32 * i;
        __m512i sum[QROWS];
        block_units_x16(f, ba + vo, bb + vo, x, NB, sum);
        const __m512 d16 = halfs_x16(ba, bb);
        const __m512 e16 = fmt_has_min(f) ? halfs_x16(ba + 2 * IL, bb + 2 * IL)
                                          : _mm512_mul_ps(d16, _mm512_set1_ps(-(float)units_offset(f)));
        for (int b = 0; b < NB; b++) {
            acc[b] = _mm512_fmadd_ps(_mm512_mul_ps(d16, _mm512_set1_ps(in.dh[b][i])), _mm512_cvtepi32_ps(sum[b]), acc[b]);
            acc[b] = _mm512_fmadd_ps(e16, _mm512_set1_ps(in.ds[b][i]), acc[b]);
        }
    }
    if (P == 2)
        for (int64_t i0 = 0; i0 < blocks; i0 += 32)
            for (uint32_t bits = loud_blocks(&in, i0, blocks - i0 < 32 ? blocks - i0 : 32, NB); bits; bits &= bits - 1) {
                const int64_t i = i0 + __builtin_ctz(bits);
                const uint8_t *ba = grp + i * bytes, *bb = ba + group_bytes;
                const int8_t *x[QROWS];
                for (int b = 0; b < NB; b++) x[b] = in.lo[b] + 32 * i;
                __m512i sum[QROWS];
                block_units_x16(f, ba + vo, bb + vo, x, NB, sum);
                const __m512 d16 = halfs_x16(ba, bb);
                for (int b = 0; b < NB; b++)
                    acc[b] = _mm512_fmadd_ps(_mm512_mul_ps(d16, _mm512_set1_ps(in.d[b][i])), _mm512_cvtepi32_ps(sum[b]), acc[b]);
            }
    for (int b = 0; b < NB; b++) _mm512_storeu_ps(out[b], acc[b]);
}
#endif

/* (the x8 layouts' row loops and repack_x8 follow the K-quants' interleaved kernels, below) */
void to_f32_q8_0x8(const Linear *m, int64_t r, float *out) { to_f32_fmt32x8(FMT_Q8_0, m, r, out); }
void to_f32_q4_0x8(const Linear *m, int64_t r, float *out) { to_f32_fmt32x8(FMT_Q4_0, m, r, out); }
void to_f32_q4_1x8(const Linear *m, int64_t r, float *out) { to_f32_fmt32x8(FMT_Q4_1, m, r, out); }
void to_f32_q5_0x8(const Linear *m, int64_t r, float *out) { to_f32_fmt32x8(FMT_Q5_0, m, r, out); }
void to_f32_q5_1x8(const Linear *m, int64_t r, float *out) { to_f32_fmt32x8(FMT_Q5_1, m, r, out); }

/* ---- the K-quants: super-blocks of 256 --------------------------------------------------------
 * Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of
 *   nibbles: 32 bytes per 64 values, low nibbles the first 32, high the next. w = d sc q - dmin mn.
 * Q6_K (210 bytes): ql[128] low 4 bits, qh[64] high 2 bits, int8 scales[16] (one per 16 values),
 *   fp16 d. w = d sc (q - 32). Per 128 values: ql[0..64), qh[0..32); value l of each 32-value
 *   quarter t has low bits ql[l + 32 (t & 1)] >> 4 (t >> 1) and high bits qh[l] >> 2t. */

/* The 6-bit scales and mins of a Q4_K super-block. */
static inline void q4k_scales(const uint8_t *p, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = p[j] & 63;
        mn[j] = p[j + 4] & 63;
        sc[j + 4] = (p[j + 8] & 0x0F) | ((p[j] >> 6) << 4);
        mn[j + 4] = (p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4);
    }
}

/* The 256 stored values of a super-block (Q4_K: 0..15; Q6_K: 0..63, before the -32). */
static inline void q4k_values(const uint8_t *blk, int32_t v[256]) {
    const uint8_t *qs = blk + 16;
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            v[64 * c + l] = qs[32 * c + l] & 0x0F;
            v[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
}

static inline void q6k_values(const uint8_t *blk, int32_t v[256]) {
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
        for (int t = 0; t < 4; t++)
            for (int l = 0; l < 32; l++)
                v[128 * h + 32 * t + l] = ((ql[l + 32 * (t & 1)] >> (4 * (t >> 1))) & 0x0F) | (((qh[l] >> (2 * t)) & 3) << 4);
    }
}

/* The K-quants' per-row finish of one super-block: acc (SIMD: the two input planes' integer
 * sums, combined in fp32, since 127 (w . hi) can pass 2^31 under Q6_K's 8-bit scales) or the
 * plain C sum over sub-blocks of `len` values, each scale[j] (v . X). */
#if QUANT_SIMD
static inline __m256 add_planes(__m256 acc, float scale, __m256i hi, __m256i lo) {
    acc = _mm256_fmadd_ps(_mm256_set1_ps(127.0f * scale), _mm256_cvtepi32_ps(hi), acc);
    return _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(lo), acc);
}
#else
static inline int64_t scaled_sub_blocks(const int32_t *v, const int32_t *scale, int parts, int len, const int8_t *hi,
                                        const int8_t *lo) {
    int64_t sum = 0;
    for (int j = 0; j < parts; j++) {
        int64_t part = 0;
        for (int l = 0; l < len; l++) part += v[len * j + l] * x_at(hi, lo, len * j + l);
        sum += scale[j] * part;
    }
    return sum;
}
#endif

#if QUANT_SIMD
static inline __attribute__((always_inline)) void dot_q4_k(const uint8_t *w, const QuantRows *q, int64_t b0,
                                                          const int NB, float *out) {
    const int64_t supers = q->k / 256;
    const InputRows in = input_rows(q, b0, NB);
    float acc_s[QROWS] = {0}, corr[QROWS] = {0};
    __m256 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();
    for (int64_t i = 0; i < supers; i++) {
        const uint8_t *blk = w + i * 144;
        const float d = f16_to_f32(read_u16(blk)), dmin = f16_to_f32(read_u16(blk + 2));
        uint8_t sc[8], mn[8];
        q4k_scales(blk + 4, sc, mn);
        __m256i sumi[QROWS], sumi_lo[QROWS];
        for (int b = 0; b < NB; b++) sumi[b] = sumi_lo[b] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i q4 = load_i8(blk + 16 + 32 * c);
            const __m256i lo = _mm256_and_si256(q4, _mm256_set1_epi8(0x0F));
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), _mm256_set1_epi8(0x0F));
            const __m256i s_lo = _mm256_set1_epi16(sc[2 * c]), s_hi = _mm256_set1_epi16(sc[2 * c + 1]);
            for (int b = 0; b < NB; b++) {
                const int8_t *xh = in.hi[b] + i * 256 + 64 * c, *xl = in.lo[b] + i * 256 + 64 * c;
                sumi[b] = _mm256_add_epi32(sumi[b], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load_i8(xh)), s_lo));
                sumi[b] = _mm256_add_epi32(sumi[b], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load_i8(xh + 32)), s_hi));
                sumi_lo[b] = _mm256_add_epi32(sumi_lo[b], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load_i8(xl)), s_lo));
                sumi_lo[b] = _mm256_add_epi32(sumi_lo[b], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load_i8(xl + 32)), s_hi));
            }
        }
        for (int b = 0; b < NB; b++) {
            const float dx = in.d[b][i];
            const int32_t *s16 = in.sums[b] + i * 16;
            int32_t msum = 0;
            for (int j = 0; j < 8; j++) msum += (int32_t)mn[j] * (s16[2 * j] + s16[2 * j + 1]);
            corr[b] -= dmin * dx * (float)msum;
            acc[b] = add_planes(acc[b], d * dx, sumi[b], sumi_lo[b]);
        }
    }
    for (int b = 0; b < NB; b++) acc_s[b] = hsum_ps(acc[b]);
    for (int b = 0; b < NB; b++) out[b] = acc_s[b] + corr[b];
}
#else
static inline __attribute__((always_inline)) void dot_q4_k(const uint8_t *w, const QuantRows *q, int64_t b0,
                                                          const int NB, float *out) {
    const int64_t supers = q->k / 256;
    const InputRows in = input_rows(q, b0, NB);
    float acc_s[QROWS] = {0}, corr[QROWS] = {0};
    for (int64_t i = 0; i < supers; i++) {
        const uint8_t *blk = w + i * 144;
        const float d = f16_to_f32(read_u16(blk)), dmin = f16_to_f32(read_u16(blk + 2));
        uint8_t sc[8], mn[8];
        q4k_scales(blk + 4, sc, mn);
        int32_t v[256];
        q4k_values(blk, v);
        for (int b = 0; b < NB; b++) {
            const float dx = in.d[b][i];
            const int32_t *s16 = in.sums[b] + i * 16;
            int32_t msum = 0;
            for (int j = 0; j < 8; j++) msum += (int32_t)mn[j] * (s16[2 * j] + s16[2 * j + 1]);
            corr[b] -= dmin * dx * (float)msum;
            int32_t scale[8];
            for (int j = 0; j < 8; j++) scale[j] = sc[j];
            acc_s[b] += d * dx * (float)scaled_sub_blocks(v, scale, 8, 32, in.hi[b] + i * 256, in.lo[b] + i * 256);
        }
    }
    for (int b = 0; b < NB; b++) out[b] = acc_s[b] + corr[b];
}
#endif

#if QUANT_SIMD
static inline __attribute__((always_inline)) void dot_q6_k(const uint8_t *w, const QuantRows *q, int64_t b0,
                                                          const int NB, float *out) {
    const int64_t supers = q->k / 256;
    const InputRows in = input_rows(q, b0, NB);
    float acc_s[QROWS] = {0}, corr[QROWS] = {0};
    __m256 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();
    for (int64_t i = 0; i < supers; i++) {
        const uint8_t *blk = w + i * 210;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = f16_to_f32(read_u16(blk + 208));
        __m256i sumi[QROWS], sumi_lo[QROWS];
        for (int b = 0; b < NB; b++) sumi[b] = sumi_lo[b] = _mm256_setzero_si256();
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        for (int h = 0; h < 2; h++) {
            const __m256i ql0 = load_i8(blk + 64 * h), ql1 = load_i8(blk + 64 * h + 32), qh = load_i8(blk + 128 + 32 * h);
            __m256i v[4];
            v[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0x03)), 4));
            v[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0x0C)), 2));
            v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, _mm256_set1_epi8(0x30)));
            v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                   _mm256_and_si256(_mm256_srli_epi16(qh, 2), _mm256_set1_epi8(0x30)));
            for (int t = 0; t < 4; t++) {
                /* 32 values, two scales: the first 16 values' in the low half, the next 16's in the high */
                const __m256i s = _mm256_set_m128i(_mm_set1_epi16(sc[8 * h + 2 * t + 1]), _mm_set1_epi16(sc[8 * h + 2 * t]));
                for (int b = 0; b < NB; b++) {
                    const int64_t at = i * 256 + 128 * h + 32 * t;
                    sumi[b] = _mm256_add_epi32(sumi[b], _mm256_madd_epi16(_mm256_maddubs_epi16(v[t], load_i8(in.hi[b] + at)), s));
                    sumi_lo[b] = _mm256_add_epi32(sumi_lo[b], _mm256_madd_epi16(_mm256_maddubs_epi16(v[t], load_i8(in.lo[b] + at)), s));
                }
            }
        }
        for (int b = 0; b < NB; b++) {
            const float dx = in.d[b][i];
            const int32_t *s16 = in.sums[b] + i * 16;
            int32_t off = 0;
            for (int j = 0; j < 16; j++) off += (int32_t)sc[j] * s16[j];
            corr[b] -= 32.0f * d * dx * (float)off;
            acc[b] = add_planes(acc[b], d * dx, sumi[b], sumi_lo[b]);
        }
    }
    for (int b = 0; b < NB; b++) acc_s[b] = hsum_ps(acc[b]);
    for (int b = 0; b < NB; b++) out[b] = acc_s[b] + corr[b];
}
#else
static inline __attribute__((always_inline)) void dot_q6_k(const uint8_t *w, const QuantRows *q, int64_t b0,
                                                          const int NB, float *out) {
    const int64_t supers = q->k / 256;
    const InputRows in = input_rows(q, b0, NB);
    float acc_s[QROWS] = {0}, corr[QROWS] = {0};
    for (int64_t i = 0; i < supers; i++) {
        const uint8_t *blk = w + i * 210;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = f16_to_f32(read_u16(blk + 208));
        int32_t v[256];
        q6k_values(blk, v);
        for (int b = 0; b < NB; b++) {
            const float dx = in.d[b][i];
            const int32_t *s16 = in.sums[b] + i * 16;
            int32_t off = 0;
            for (int j = 0; j < 16; j++) off += (int32_t)sc[j] * s16[j];
            corr[b] -= 32.0f * d * dx * (float)off;
            int32_t scale[16];
            for (int j = 0; j < 16; j++) scale[j] = sc[j];
            acc_s[b] += d * dx * (float)scaled_sub_blocks(v, scale, 16, 16, in.hi[b] + i * 256, in.lo[b] + i * 256);
        }
    }
    for (int b = 0; b < NB; b++) out[b] = acc_s[b] + corr[b];
}
#endif

void to_f32_q4_k(const Linear *m, int64_t r, float *out) {
    const uint8_t *row = (const uint8_t *)m->data + r * m->row_bytes;
    for (int64_t i = 0; i < m->k / 256; i++) {
        const uint8_t *blk = row + i * 144;
        const float d = f16_to_f32(read_u16(blk)), dmin = f16_to_f32(read_u16(blk + 2));
        uint8_t sc[8], mn[8];
        q4k_scales(blk + 4, sc, mn);
        int32_t v[256];
        q4k_values(blk, v);
        for (int j = 0; j < 256; j++) out[i * 256 + j] = d * (float)sc[j / 32] * (float)v[j] - dmin * (float)mn[j / 32];
    }
}

void to_f32_q6_k(const Linear *m, int64_t r, float *out) {
    const uint8_t *row = (const uint8_t *)m->data + r * m->row_bytes;
    for (int64_t i = 0; i < m->k / 256; i++) {
        const uint8_t *blk = row + i * 210;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = f16_to_f32(read_u16(blk + 208));
        int32_t v[256];
        q6k_values(blk, v);
        for (int j = 0; j < 256; j++) out[i * 256 + j] = d * (float)sc[j / 16] * (float)(v[j] - 32);
    }
}

/* ---- the K-quants interleaved by 8 rows ----------------------------------------------------------
 * Repacked at load (repack_x8, same bytes as the plain rows), per group of 8 rows and super-block,
 * so that one 32-byte load holds 4 values of each of the 8 rows, one row per 32-bit lane (as the
 * 32-weight formats' x8 layouts; integer dots with a broadcast input chunk sum 8 rows at once):
 *   q4_kx8 (1152 bytes): d[8], dmin[8] (fp16), the 12 packed scale bytes (byte b of row r at
 *          8 b + r), then 32 units of 32 bytes: unit u holds the plain qs bytes 4u..4u+3 of each
 *          row (row r at 4 r): low nibbles values 64 (u / 8) + 4 (u % 8) + 0..3 (sub-block
 *          2 (u / 8)), high nibbles the same + 32 (sub-block 2 (u / 8) + 1).
 *   q6_kx8 (1680 bytes): d[8] (fp16), the 16 int8 scales (scale j of row r at 8 j + r), then per
 *          sub-block j of 16 values 96 bytes: two low-bits units, byte e of row r holding value
 *          16 j + 8 p + e in its low nibble and 16 j + 8 p + 4 + e in its high one (p = 0, 1),
 *          then the high-bits unit, byte e of row r holding the top 2 bits of values 16 j + 4 c + e
 *          at bits 2c. A sub-block's bytes are adjacent, so the kernels read the super-block in
 *          one forward stream: with the high bits in a region of their own after the low bits
 *          (two streams, restarting every super-block), Q6_K rows streamed from memory at half
 *          Q4_0's and Q8_0's rate (docs/performance.md). */
#define Q4K_X8 (IL * 144)
#define Q6K_X8 (IL * 210)

/* The plain Q6_K values' bits back into ql / qh (q6k_values' inverse). */
static void q6k_pack(const int32_t v[256], uint8_t *blk) {
    memset(blk, 0, 192);
    for (int h = 0; h < 2; h++) {
        uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
        for (int t = 0; t < 4; t++)
            for (int l = 0; l < 32; l++) {
                const int32_t q = v[128 * h + 32 * t + l];
                ql[l + 32 * (t & 1)] |= (uint8_t)((q & 0x0F) << (4 * (t >> 1)));
                qh[l] |= (uint8_t)((q >> 4) << (2 * t));
            }
    }
}

/* Copy row `lane`'s super-block between the plain layout and a group's interleaved one (to_x8 1
 * repacks, 0 unpacks), for Q4_K (q6 0) or Q6_K (q6 1). */
static void kx8_block(int q6, int to_x8, uint8_t *plain, uint8_t *x8, int lane) {
    if (!q6) {
        for (int h = 0; h < 2; h++) /* d, dmin */
            memcpy(to_x8 ? x8 + 16 * h + 2 * lane : plain + 2 * h, to_x8 ? plain + 2 * h : x8 + 16 * h + 2 * lane, 2);
        for (int b = 0; b < 12; b++) {
            uint8_t *a = plain + 4 + b, *s = x8 + 32 + 8 * b + lane;
            *(to_x8 ? s : a) = *(to_x8 ? a : s);
        }
        for (int u = 0; u < 32; u++)
            memcpy(to_x8 ? x8 + 128 + 32 * u + 4 * lane : plain + 16 + 4 * u,
                   to_x8 ? plain + 16 + 4 * u : x8 + 128 + 32 * u + 4 * lane, 4);
        return;
    }
    memcpy(to_x8 ? x8 + 2 * lane : plain + 208, to_x8 ? plain + 208 : x8 + 2 * lane, 2);
    for (int j = 0; j < 16; j++) {
        uint8_t *a = plain + 192 + j, *s = x8 + 16 + 8 * j + lane;
        *(to_x8 ? s : a) = *(to_x8 ? a : s);
    }
    uint8_t *ql = x8 + 144, *qh = x8 + 144 + 64; /* sub-block j's units at 96 j */
    int32_t v[256];
    if (to_x8) {
        q6k_values(plain, v);
        for (int j = 0; j < 16; j++)
            for (int e = 0; e < 4; e++) {
                for (int p = 0; p < 2; p++)
                    ql[96 * j + 32 * p + 4 * lane + e] =
                        (uint8_t)((v[16 * j + 8 * p + e] & 0x0F) | ((v[16 * j + 8 * p + 4 + e] & 0x0F) << 4));
                uint8_t bits = 0;
                for (int c = 0; c < 4; c++) bits |= (uint8_t)((v[16 * j + 4 * c + e] >> 4) << (2 * c));
                qh[96 * j + 4 * lane + e] = bits;
            }
        return;
    }
    for (int j = 0; j < 16; j++)
        for (int e = 0; e < 4; e++) {
            const uint8_t bits = qh[96 * j + 4 * lane + e];
            for (int p = 0; p < 2; p++) {
                const uint8_t lo = ql[96 * j + 32 * p + 4 * lane + e];
                v[16 * j + 8 * p + e] = (lo & 0x0F) | (((bits >> (2 * (2 * p))) & 3) << 4);
                v[16 * j + 8 * p + 4 + e] = (lo >> 4) | (((bits >> (2 * (2 * p + 1))) & 3) << 4);
            }
        }
    q6k_pack(v, plain);
}

static void to_f32_kx8(int q6, const Linear *m, int64_t r, float *out) {
    const uint8_t *grp = group_of(m, r / IL);
    uint8_t plain[210];
    Linear one = *m;
    one.data = plain, one.n = 1, one.k = 256, one.row_bytes = q6 ? 210 : 144, one.next = NULL;
    for (int64_t i = 0; i < m->k / 256; i++) {
        kx8_block(q6, 0, plain, (uint8_t *)grp + i * (q6 ? Q6K_X8 : Q4K_X8), (int)(r % IL));
        if (q6)
            to_f32_q6_k(&one, 0, out + 256 * i);
        else
            to_f32_q4_k(&one, 0, out + 256 * i);
    }
}

void to_f32_q4_kx8(const Linear *m, int64_t r, float *out) { to_f32_kx8(0, m, r, out); }
void to_f32_q6_kx8(const Linear *m, int64_t r, float *out) { to_f32_kx8(1, m, r, out); }

#if !QUANT_SIMD
/* Plain C: each row's super-block unpacked to the plain layout, then dot_q4_k / dot_q6_k's arithmetic
 * on one weight row. */
static void dot_kx8_plain(int q6, const uint8_t *grp, const QuantRows *q, int64_t b0, const int NB,
                          float out[QROWS][IL]) {
    const int64_t supers = q->k / 256;
    for (int r = 0; r < IL; r++) {
        uint8_t *row = malloc((size_t)supers * 210);
        if (row == NULL) { /* skipped; the caller reports the failure */
            note_kernel_failure();
            for (int b = 0; b < NB; b++) out[b][r] = 0.0f;
            continue;
        }
        for (int64_t i = 0; i < supers; i++)
            kx8_block(q6, 0, row + i * (q6 ? 210 : 144), (uint8_t *)grp + i * (q6 ? Q6K_X8 : Q4K_X8), r);
        float dot[QROWS];
        if (q6)
            dot_q6_k(row, q, b0, NB, dot);
        else
            dot_q4_k(row, q, b0, NB, dot);
        for (int b = 0; b < NB; b++) out[b][r] = dot[b];
        free(row);
    }
}
#endif

#if QUANT_SIMD
/* lane r of the result = the int8 at p[r] (r < 8), sign- or zero-extended */
static inline __m256i lanes_i8(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline __m256i lanes_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
/* each 32-bit lane's low int16 in both halves (vpmaddwd then scales a lane's two pair sums alike) */
static inline __m256i pairs16(__m256i v) { return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16)); }
#endif

#if QUANT_SIMD
/* The 6-bit scales and mins of a q4_kx8 super-block's 8 rows, sub-block j's at sc[8 j .. 8 j + 8)
 * (q4k_scales, 8 rows at once). */
static inline void q4k_scales_x8(const uint8_t *blk, uint8_t sc[64], uint8_t mn[64]) {
    const __m128i m6 = _mm_set1_epi8(63), m4b = _mm_set1_epi8(0x0F), m2 = _mm_set1_epi8(3);
    for (int j = 0; j < 4; j++) {
        const __m128i p = _mm_loadl_epi64((const __m128i *)(blk + 32 + 8 * j));
        const __m128i pm = _mm_loadl_epi64((const __m128i *)(blk + 32 + 8 * (j + 4)));
        const __m128i ph = _mm_loadl_epi64((const __m128i *)(blk + 32 + 8 * (j + 8)));
        _mm_storel_epi64((__m128i *)(sc + 8 * j), _mm_and_si128(p, m6));
        _mm_storel_epi64((__m128i *)(mn + 8 * j), _mm_and_si128(pm, m6));
        _mm_storel_epi64((__m128i *)(sc + 8 * (j + 4)),
                         _mm_or_si128(_mm_and_si128(ph, m4b), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(p, 6), m2), 4)));
        _mm_storel_epi64((__m128i *)(mn + 8 * (j + 4)),
                         _mm_or_si128(_mm_and_si128(_mm_srli_epi16(ph, 4), m4b),
                                      _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(pm, 6), m2), 4)));
    }
}
#endif

/* out[b][r] = row 8 g + r of the group . input row b0 + b, b < NB (Q4_K). Per super-block and row
 * the sub-block sums of the two planes are scaled in integers (vpmaddwd by the lane's scale) or, with
 * VNNI, in fp32; the mins come off as dmin (sum over sub-blocks of mn X-sums), from the input's sums. */
#if QUANT_SIMD && QUANT_VNNI
static inline __attribute__((always_inline)) void dot_q4_kx8(const uint8_t *grp, const QuantRows *q, int64_t b0,
                                                            const int NB, const int P, float out[QROWS][IL]) {
    const int64_t supers = q->k / 256;
    const InputRows in = input_rows(q, b0, NB);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();
    for (int64_t i = 0; i < supers; i++) {
        const uint8_t *blk = grp + i * Q4K_X8, *units = blk + 128;
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 dm8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        uint8_t sc[64], mn[64];
        q4k_scales_x8(blk, sc, mn);
        __m256 sub[QROWS]; /* sum over sub-blocks of scale x (127 (w . hi) + (w . lo)), in fp32 */
        for (int b = 0; b < NB; b++) sub[b] = _mm256_setzero_ps();
        int two[QROWS]; /* the low plane's products are taken (its values are zero elsewhere) */
        for (int b = 0; b < NB; b++) two[b] = P == 2 && in.two[b][i];
        for (int j = 0; j < 8; j++) {
            const uint8_t *u8 = units + 32 * 8 * (j >> 1);
            const int shift = 4 * (j & 1);
            __m256i th[QROWS], tl[QROWS], w[8];
            for (int t = 0; t < 8; t++) w[t] = _mm256_and_si256(_mm256_srli_epi16(load_i8(u8 + 32 * t), shift), m4);
            /* every row's high plane, then the low plane of the rows whose group has one */
            for (int b = 0; b < NB; b++) {
                const int8_t *xh = in.hi[b] + i * 256 + 32 * j, *xl = in.lo[b] + i * 256 + 32 * j;
                th[b] = tl[b] = _mm256_setzero_si256();
                for (int t = 0; t < 8; t++) th[b] = dot_acc(th[b], w[t], bcast4(xh + 4 * t));
                if (two[b])
                    for (int t = 0; t < 8; t++) tl[b] = dot_acc(tl[b], w[t], bcast4(xl + 4 * t));
            }
            const __m256i s32 = lanes_u8(sc + 8 * j);
            const __m256 sf = _mm256_cvtepi32_ps(s32);
            for (int b = 0; b < NB; b++) sub[b] = _mm256_fmadd_ps(sf, _mm256_cvtepi32_ps(planes(th[b], tl[b])), sub[b]);
        }
        for (int b = 0; b < NB; b++) {
            const float dx = in.d[b][i];
            const int32_t *s16 = in.sums[b] + i * 16;
            __m256 msum = _mm256_setzero_ps();
            for (int j = 0; j < 8; j++)
                msum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes_u8(mn + 8 * j)), _mm256_set1_ps((float)(s16[2 * j] + s16[2 * j + 1])), msum);
            const __m256 s = sub[b];
            acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(dx)), s, acc[b]);
            acc[b] = _mm256_fnmadd_ps(_mm256_mul_ps(dm8, _mm256_set1_ps(dx)), msum, acc[b]);
        }
    }
    for (int b = 0; b < NB; b++) _mm256_storeu_ps(out[b], acc[b]);
}
#elif QUANT_SIMD
static inline __attribute__((always_inline)) void dot_q4_kx8(const uint8_t *grp, const QuantRows *q, int64_t b0,
                                                            const int NB, const int P, float out[QROWS][IL]) {
    const int64_t supers = q->k / 256;
    const InputRows in = input_rows(q, b0, NB);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();
    for (int64_t i = 0; i < supers; i++) {
        const uint8_t *blk = grp + i * Q4K_X8, *units = blk + 128;
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 dm8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        uint8_t sc[64], mn[64];
        q4k_scales_x8(blk, sc, mn);
        __m256i sh[QROWS], sl[QROWS]; /* the two planes' scaled sums: |sh| <= 8 x 63 x 32 x 15 x 127 < 2^25 */
        for (int b = 0; b < NB; b++) sh[b] = sl[b] = _mm256_setzero_si256();
        int two[QROWS]; /* the low plane's products are taken (its values are zero elsewhere) */
        for (int b = 0; b < NB; b++) two[b] = P == 2 && in.two[b][i];
        for (int j = 0; j < 8; j++) {
            const uint8_t *u8 = units + 32 * 8 * (j >> 1);
            const int shift = 4 * (j & 1);
            __m256i th[QROWS], tl[QROWS], w[8];
            for (int t = 0; t < 8; t++) w[t] = _mm256_and_si256(_mm256_srli_epi16(load_i8(u8 + 32 * t), shift), m4);
            /* every row's high plane, then the low plane of the rows whose group has one */
            for (int b = 0; b < NB; b++) {
                const int8_t *xh = in.hi[b] + i * 256 + 32 * j, *xl = in.lo[b] + i * 256 + 32 * j;
                th[b] = tl[b] = _mm256_setzero_si256();
                /* int16 pair sums: 8 x 2 x 15 x 127 = 30,480 at most */
                for (int t = 0; t < 8; t++) th[b] = _mm256_add_epi16(th[b], _mm256_maddubs_epi16(w[t], bcast4(xh + 4 * t)));
                if (two[b])
                    for (int t = 0; t < 8; t++) tl[b] = _mm256_add_epi16(tl[b], _mm256_maddubs_epi16(w[t], bcast4(xl + 4 * t)));
            }
            const __m256i s32 = lanes_u8(sc + 8 * j);
            const __m256i s16 = pairs16(s32);
            for (int b = 0; b < NB; b++) {
                sh[b] = _mm256_add_epi32(sh[b], _mm256_madd_epi16(th[b], s16));
                if (two[b]) sl[b] = _mm256_add_epi32(sl[b], _mm256_madd_epi16(tl[b], s16));
            }
        }
        for (int b = 0; b < NB; b++) {
            const float dx = in.d[b][i];
            const int32_t *s16 = in.sums[b] + i * 16;
            __m256 msum = _mm256_setzero_ps();
            for (int j = 0; j < 8; j++)
                msum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes_u8(mn + 8 * j)), _mm256_set1_ps((float)(s16[2 * j] + s16[2 * j + 1])), msum);
            const __m256 s = _mm256_fmadd_ps(_mm256_set1_ps(127.0f), _mm256_cvtepi32_ps(sh[b]), _mm256_cvtepi32_ps(sl[b]));
            acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(dx)), s, acc[b]);
            acc[b] = _mm256_fnmadd_ps(_mm256_mul_ps(dm8, _mm256_set1_ps(dx)), msum, acc[b]);
        }
    }
    for (int b = 0; b < NB; b++) _mm256_storeu_ps(out[b], acc[b]);
}
#else
static inline __attribute__((always_inline)) void dot_q4_kx8(const uint8_t *grp, const QuantRows *q, int64_t b0,
                                                            const int NB, const int P, float out[QROWS][IL]) {
    (void)P;
    dot_kx8_plain(0, grp, q, b0, NB, out);
}
#endif

/* The same for Q6_K: values 0..63 (the -32 comes off as 32 (sum over sub-blocks of scale x X-sum)). */
#if QUANT_SIMD && QUANT_VNNI
static inline __attribute__((always_inline)) void dot_q6_kx8(const uint8_t *grp, const QuantRows *q, int64_t b0,
                                                            const int NB, const int P, float out[QROWS][IL]) {
    const int64_t supers = q->k / 256;
    const InputRows in = input_rows(q, b0, NB);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    __m256 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();
    for (int64_t i = 0; i < supers; i++) {
        const uint8_t *blk = grp + i * Q6K_X8, *scales = blk + 16, *units = blk + 144;
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256 sub[QROWS];
        for (int b = 0; b < NB; b++) sub[b] = _mm256_setzero_ps();
        int two[QROWS]; /* the low plane's products are taken (its values are zero elsewhere) */
        for (int b = 0; b < NB; b++) two[b] = P == 2 && in.two[b][i];
        for (int j = 0; j < 16; j++) {
            const uint8_t *sub_block = units + 96 * j;
            const __m256i u0 = load_i8(sub_block), u1 = load_i8(sub_block + 32), h = load_i8(sub_block + 64);
            /* the 4 chunks of sub-block j: values 16 j + 4 c + 0..3 of each row (the high bits masked
             * after the 16-bit shifts, so no bit crosses into the next byte) */
            __m256i w[4];
            w[0] = _mm256_or_si256(_mm256_and_si256(u0, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
            w[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(u0, 4), m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
            w[2] = _mm256_or_si256(_mm256_and_si256(u1, m4), _mm256_and_si256(h, m30));
            w[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(u1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
            const __m256i s32 = lanes_i8(scales + 8 * j);
            const __m256 sf = _mm256_cvtepi32_ps(s32);
            for (int b = 0; b < NB; b++) {
                const int8_t *xh = in.hi[b] + i * 256 + 16 * j, *xl = in.lo[b] + i * 256 + 16 * j;
                __m256i th = _mm256_setzero_si256(), tl = _mm256_setzero_si256();
                for (int c = 0; c < 4; c++) th = dot_acc(th, w[c], bcast4(xh + 4 * c));
                if (two[b])
                    for (int c = 0; c < 4; c++) tl = dot_acc(tl, w[c], bcast4(xl + 4 * c));
                /* |127 th + tl| <= 16 x 63 x 16,129 < 2^24: exact in fp32 */
                sub[b] = _mm256_fmadd_ps(sf, _mm256_cvtepi32_ps(planes(th, tl)), sub[b]);
            }
        }
        for (int b = 0; b < NB; b++) {
            const float dx = in.d[b][i];
            const int32_t *s16 = in.sums[b] + i * 16;
            __m256 off = _mm256_setzero_ps();
            for (int j = 0; j < 16; j++)
                off = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes_i8(scales + 8 * j)), _mm256_set1_ps((float)s16[j]), off);
            __m256 s = sub[b];
            s = _mm256_fnmadd_ps(_mm256_set1_ps(32.0f), off, s);
            acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(dx)), s, acc[b]);
        }
    }
    for (int b = 0; b < NB; b++) _mm256_storeu_ps(out[b], acc[b]);
}
#elif QUANT_SIMD
static inline __attribute__((always_inline)) void dot_q6_kx8(const uint8_t *grp, const QuantRows *q, int64_t b0,
                                                            const int NB, const int P, float out[QROWS][IL]) {
    const int64_t supers = q->k / 256;
    const InputRows in = input_rows(q, b0, NB);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    __m256 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();
    for (int64_t i = 0; i < supers; i++) {
        const uint8_t *blk = grp + i * Q6K_X8, *scales = blk + 16, *units = blk + 144;
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256i sh[QROWS], sl[QROWS]; /* |sh| <= 16 x 128 x 16 x 63 x 127 < 2^29 */
        for (int b = 0; b < NB; b++) sh[b] = sl[b] = _mm256_setzero_si256();
        int two[QROWS]; /* the low plane's products are taken (its values are zero elsewhere) */
        for (int b = 0; b < NB; b++) two[b] = P == 2 && in.two[b][i];
        for (int j = 0; j < 16; j++) {
            const uint8_t *sub_block = units + 96 * j;
            const __m256i u0 = load_i8(sub_block), u1 = load_i8(sub_block + 32), h = load_i8(sub_block + 64);
            /* the 4 chunks of sub-block j: values 16 j + 4 c + 0..3 of each row (the high bits masked
             * after the 16-bit shifts, so no bit crosses into the next byte) */
            __m256i w[4];
            w[0] = _mm256_or_si256(_mm256_and_si256(u0, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
            w[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(u0, 4), m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
            w[2] = _mm256_or_si256(_mm256_and_si256(u1, m4), _mm256_and_si256(h, m30));
            w[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(u1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
            const __m256i s32 = lanes_i8(scales + 8 * j);
            const __m256i s16 = pairs16(s32);
            for (int b = 0; b < NB; b++) {
                const int8_t *xh = in.hi[b] + i * 256 + 16 * j, *xl = in.lo[b] + i * 256 + 16 * j;
                /* int16 pair sums of two chunks: 2 x 2 x 63 x 127 = 32,004 at most */
                for (int c = 0; c < 4; c += 2) {
                    const __m256i th = _mm256_add_epi16(_mm256_maddubs_epi16(w[c], bcast4(xh + 4 * c)),
                                                        _mm256_maddubs_epi16(w[c + 1], bcast4(xh + 4 * c + 4)));
                    sh[b] = _mm256_add_epi32(sh[b], _mm256_madd_epi16(th, s16));
                    if (two[b]) {
                        const __m256i tl = _mm256_add_epi16(_mm256_maddubs_epi16(w[c], bcast4(xl + 4 * c)),
                                                            _mm256_maddubs_epi16(w[c + 1], bcast4(xl + 4 * c + 4)));
                        sl[b] = _mm256_add_epi32(sl[b], _mm256_madd_epi16(tl, s16));
                    }
                }
            }
        }
        for (int b = 0; b < NB; b++) {
            const float dx = in.d[b][i];
            const int32_t *s16 = in.sums[b] + i * 16;
            __m256 off = _mm256_setzero_ps();
            for (int j = 0; j < 16; j++)
                off = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes_i8(scales + 8 * j)), _mm256_set1_ps((float)s16[j]), off);
            __m256 s = _mm256_fmadd_ps(_mm256_set1_ps(127.0f), _mm256_cvtepi32_ps(sh[b]), _mm256_cvtepi32_ps(sl[b]));
            s = _mm256_fnmadd_ps(_mm256_set1_ps(32.0f), off, s);
            acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(dx)), s, acc[b]);
        }
    }
    for (int b = 0; b < NB; b++) _mm256_storeu_ps(out[b], acc[b]);
}
#else
static inline __attribute__((always_inline)) void dot_q6_kx8(const uint8_t *grp, const QuantRows *q, int64_t b0,
                                                            const int NB, const int P, float out[QROWS][IL]) {
    (void)P;
    dot_kx8_plain(1, grp, q, b0, NB, out);
}
#endif

#if QUANT_VNNI512
/* 8 bytes at a and 8 at b as 16 int32 lanes (a's first). */
static inline __m512i lanes_u8x16(const uint8_t *a, const uint8_t *b) {
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b)));
}
static inline __m512i lanes_i8x16(const uint8_t *a, const uint8_t *b) {
    return _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b)));
}
/* sub + scale x (w . X) for one K-quant sub-block of 4 x chunks values (w[c]: chunk c's values of the
 * 16 rows; xh / xl: the input's planes there, xl's products taken where two), in fp32
 * (|127 th + tl| <= 32 x 15 x 16,129 for Q4_K, 16 x 63 x 16,129 for Q6_K: < 2^24, exact). */
static inline __attribute__((always_inline)) __m512 add_sub_block(__m512 sub, __m512 scale, const __m512i *w, const int chunks,
                                                                  const int8_t *xh, const int8_t *xl, int two) {
    __m512i th = _mm512_setzero_si512(), tl = _mm512_setzero_si512();
    for (int c = 0; c < chunks; c++) th = _mm512_dpbusd_epi32(th, w[c], bcast4x16(xh + 4 * c));
    if (two)
        for (int c = 0; c < chunks; c++) tl = _mm512_dpbusd_epi32(tl, w[c], bcast4x16(xl + 4 * c));
    return _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(th, 7), th), tl)), sub);
}

/* dot_q4_kx8 for two 8-row groups at once (grp and grp + group_bytes), as dot_units32x16 is for the
 * 32-weight formats. */
static inline __attribute__((always_inline)) void dot_q4_kx16(const uint8_t *grp, int64_t group_bytes, const QuantRows *q,
                                                             int64_t b0, const int NB, const int P,
                                                             float out[QROWS][2 * IL]) {
    const int64_t supers = q->k / 256;
    const InputRows in = input_rows(q, b0, NB);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm512_setzero_ps();
    for (int64_t i = 0; i < supers; i++) {
        const uint8_t *ba = grp + i * Q4K_X8, *bb = ba + group_bytes;
        const __m512 d16 = halfs_x16(ba, bb), dm16 = halfs_x16(ba + 16, bb + 16);
        uint8_t sa[64], ma[64], sb[64], mb[64];
        q4k_scales_x8(ba, sa, ma);
        q4k_scales_x8(bb, sb, mb);
        __m512 sub[QROWS];
        int two[QROWS];
        for (int b = 0; b < NB; b++) sub[b] = _mm512_setzero_ps(), two[b] = P == 2 && in.two[b][i];
        for (int j = 0; j < 8; j++) {
            const uint8_t *ua = ba + 128 + 32 * 8 * (j >> 1), *ub = bb + 128 + 32 * 8 * (j >> 1);
            const int shift = 4 * (j & 1);
            __m512i w[8];
            for (int t = 0; t < 8; t++) w[t] = _mm512_and_si512(_mm512_srli_epi16(load_pair(ua + 32 * t, ub + 32 * t), shift), m4);
            const __m512 sf = _mm512_cvtepi32_ps(lanes_u8x16(sa + 8 * j, sb + 8 * j));
            for (int b = 0; b < NB; b++)
                sub[b] = add_sub_block(sub[b], sf, w, 8, in.hi[b] + i * 256 + 32 * j, in.lo[b] + i * 256 + 32 * j, two[b]);
        }
        for (int b = 0; b < NB; b++) {
            const float dx = in.d[b][i];
            const int32_t *s16 = in.sums[b] + i * 16;
            __m512 msum = _mm512_setzero_ps();
            for (int j = 0; j < 8; j++)
                msum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes_u8x16(ma + 8 * j, mb + 8 * j)),
                                       _mm512_set1_ps((float)(s16[2 * j] + s16[2 * j + 1])), msum);
            acc[b] = _mm512_fmadd_ps(_mm512_mul_ps(d16, _mm512_set1_ps(dx)), sub[b], acc[b]);
            acc[b] = _mm512_fnmadd_ps(_mm512_mul_ps(dm16, _mm512_set1_ps(dx)), msum, acc[b]);
        }
    }
    for (int b = 0; b < NB; b++) _mm512_storeu_ps(out[b], acc[b]);
}

/* dot_q6_kx8 for two 8-row groups at once. */
static inline __attribute__((always_inline)) void dot_q6_kx16(const uint8_t *grp, int64_t group_bytes, const QuantRows *q,
                                                             int64_t b0, const int NB, const int P,
                                                             float out[QROWS][2 * IL]) {
    const int64_t supers = q->k / 256;
    const InputRows in = input_rows(q, b0, NB);
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    __m512 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm512_setzero_ps();
    for (int64_t i = 0; i < supers; i++) {
        const uint8_t *ba = grp + i * Q6K_X8, *bb = ba + group_bytes;
        const __m512 d16 = halfs_x16(ba, bb);
        __m512 sub[QROWS];
        int two[QROWS];
        for (int b = 0; b < NB; b++) sub[b] = _mm512_setzero_ps(), two[b] = P == 2 && in.two[b][i];
        for (int j = 0; j < 16; j++) {
            const uint8_t *sa = ba + 144 + 96 * j, *sb = bb + 144 + 96 * j;
            const __m512i u0 = load_pair(sa, sb), u1 = load_pair(sa + 32, sb + 32), h = load_pair(sa + 64, sb + 64);
            __m512i w[4];
            w[0] = _mm512_or_si512(_mm512_and_si512(u0, m4), _mm512_and_si512(_mm512_slli_epi16(h, 4), m30));
            w[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(u0, 4), m4), _mm512_and_si512(_mm512_slli_epi16(h, 2), m30));
            w[2] = _mm512_or_si512(_mm512_and_si512(u1, m4), _mm512_and_si512(h, m30));
            w[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(u1, 4), m4), _mm512_and_si512(_mm512_srli_epi16(h, 2), m30));
            const __m512 sf = _mm512_cvtepi32_ps(lanes_i8x16(ba + 16 + 8 * j, bb + 16 + 8 * j));
            for (int b = 0; b < NB; b++)
                sub[b] = add_sub_block(sub[b], sf, w, 4, in.hi[b] + i * 256 + 16 * j, in.lo[b] + i * 256 + 16 * j, two[b]);
        }
        for (int b = 0; b < NB; b++) {
            const float dx = in.d[b][i];
            const int32_t *s16 = in.sums[b] + i * 16;
            __m512 off = _mm512_setzero_ps();
            for (int j = 0; j < 16; j++)
                off = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes_i8x16(ba + 16 + 8 * j, bb + 16 + 8 * j)), _mm512_set1_ps((float)s16[j]), off);
            acc[b] = _mm512_fmadd_ps(_mm512_mul_ps(d16, _mm512_set1_ps(dx)), _mm512_fnmadd_ps(_mm512_set1_ps(32.0f), off, sub[b]), acc[b]);
        }
    }
    for (int b = 0; b < NB; b++) _mm512_storeu_ps(out[b], acc[b]);
}
#endif

/* An interleaved format's LinearRows: the inputs quantized in groups of GROUP (X16: also kept in
 * int16), then each thread takes its share of the 8-row groups (W = 16 and at least X16_MIN_ROWS
 * input rows: of the pairs of groups, a last odd group on its own), QROWS input rows per pass.
 * X16_MIN_ROWS: a pair is read as two forward streams, which a Zen 4 core (zmm as two 256-bit
 * halves) fetches from memory slower than one group's single stream; at a few rows, bound by
 * those bytes, single groups win, and from 8 rows on the pairs' arithmetic does
 * (docs/performance.md item 36). */
#define X16_MIN_ROWS 8
#define X8_PASS(NAME, W, grp, gb, b0, dot)                                                                   \
    switch ((rows - b0 < QROWS ? rows - b0 : QROWS) + (one ? QROWS : 0)) {                                   \
    case 1: NAME(grp, gb, &q, b0, 1, 2, dot); break;                                                         \
    case 2: NAME(grp, gb, &q, b0, 2, 2, dot); break;                                                         \
    case 3: NAME(grp, gb, &q, b0, 3, 2, dot); break;                                                         \
    case 4: NAME(grp, gb, &q, b0, 4, 2, dot); break;                                                         \
    case 5: NAME(grp, gb, &q, b0, 1, 1, dot); break;                                                         \
    case 6: NAME(grp, gb, &q, b0, 2, 1, dot); break;                                                         \
    case 7: NAME(grp, gb, &q, b0, 3, 1, dot); break;                                                         \
    default: NAME(grp, gb, &q, b0, 4, 1, dot); break;                                                        \
    }
#define DEFINE_X8_LINEAR_ROWS_W(NAME, GROUP, X16, DOT_CALL, W, DOT16_CALL)                                      \
    static inline __attribute__((always_inline)) void NAME##_dot(const uint8_t *grp, int64_t gb, const QuantRows *q, \
                                                                int64_t b0, const int NB, const int P,           \
                                                                float out[QROWS][IL]) {                          \
        (void)gb;                                                                                                \
        DOT_CALL;                                                                                                \
    }                                                                                                            \
    static inline __attribute__((always_inline)) void NAME##_dot16(const uint8_t *grp, int64_t gb,               \
                                                                  const QuantRows *q, int64_t b0, const int NB,  \
                                                                  const int P, float out[QROWS][2 * IL]) {       \
        (void)grp, (void)gb, (void)q, (void)b0, (void)NB, (void)P, (void)out;                                   \
        DOT16_CALL;                                                                                              \
    }                                                                                                            \
    void NAME(const Linear *m, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy) {               \
        QuantRows q;                                                                                             \
        const int one = m->input_planes == 1;                                                                    \
        /* no scratch for the quantized rows: this thread's share is skipped, the caller reports it */     \
        const int no_rows = quantize_rows(x, ldx, rows, m->k, GROUP, X16, input_mode(m), &q);                   \
        if (no_rows) note_kernel_failure();                                                                      \
        const int pairs = W == 16 && rows >= X16_MIN_ROWS;                                                       \
        const int64_t groups = m->n / IL, units = pairs ? (groups + 1) / 2 : groups;                             \
        const int64_t gb = IL * m->row_bytes;                                                                    \
        _Pragma("omp for schedule(static) nowait") for (int64_t u = 0; u < units; u++) {                         \
            if (no_rows) continue;                                                                               \
            const int64_t g = pairs ? 2 * u : u;                                                                 \
            const uint8_t *grp = group_of(m, g);                                                                 \
            const int wide = pairs && g + 1 < groups, width = wide ? 2 * IL : IL;                                \
            for (int64_t b0 = 0; b0 < rows; b0 += QROWS) {                                                       \
                const int64_t nb = rows - b0 < QROWS ? rows - b0 : QROWS;                                        \
                float dot[QROWS][2 * IL], dot8[QROWS][IL];                                                       \
                if (wide) {                                                                                      \
                    X8_PASS(NAME##_dot16, W, grp, gb, b0, dot)                                                   \
                } else {                                                                                         \
                    X8_PASS(NAME##_dot, W, grp, gb, b0, dot8)                                                    \
                    for (int64_t b = 0; b < nb; b++) memcpy(dot[b], dot8[b], sizeof dot8[b]);                    \
                }                                                                                                \
                for (int64_t b = 0; b < nb; b++)                                                                 \
                    for (int r = 0; r < width; r++)                                                              \
                        y[(b0 + b) * ldy + g * IL + r] = dot[b][r] + (m->bias != NULL ? m->bias[g * IL + r] : 0.0f); \
            }                                                                                                    \
        }                                                                                                        \
    }
#define DEFINE_X8_LINEAR_ROWS(NAME, GROUP, X16, DOT_CALL) DEFINE_X8_LINEAR_ROWS_W(NAME, GROUP, X16, DOT_CALL, 8, (void)0)
#if QUANT_VNNI512
#define DEFINE_X16_LINEAR_ROWS(NAME, FMT) \
    DEFINE_X8_LINEAR_ROWS_W(NAME, 32, 0, dot_fmt32x8(FMT, grp, q, b0, NB, P, out), 16, dot_units32x16(FMT, grp, gb, q, b0, NB, P, out))
#else
#define DEFINE_X16_LINEAR_ROWS(NAME, FMT) DEFINE_X8_LINEAR_ROWS(NAME, 32, FMT == FMT_Q8_0 ? Q8_0_X16 : 0, dot_fmt32x8(FMT, grp, q, b0, NB, P, out))
#endif

DEFINE_X16_LINEAR_ROWS(linear_rows_q8_0x8, FMT_Q8_0)
DEFINE_X16_LINEAR_ROWS(linear_rows_q4_0x8, FMT_Q4_0)
DEFINE_X16_LINEAR_ROWS(linear_rows_q4_1x8, FMT_Q4_1)
DEFINE_X16_LINEAR_ROWS(linear_rows_q5_0x8, FMT_Q5_0)
DEFINE_X16_LINEAR_ROWS(linear_rows_q5_1x8, FMT_Q5_1)
#if QUANT_VNNI512
DEFINE_X8_LINEAR_ROWS_W(linear_rows_q4_kx8, 256, 0, dot_q4_kx8(grp, q, b0, NB, P, out), 16, dot_q4_kx16(grp, gb, q, b0, NB, P, out))
DEFINE_X8_LINEAR_ROWS_W(linear_rows_q6_kx8, 256, 0, dot_q6_kx8(grp, q, b0, NB, P, out), 16, dot_q6_kx16(grp, gb, q, b0, NB, P, out))
#else
DEFINE_X8_LINEAR_ROWS(linear_rows_q4_kx8, 256, 0, dot_q4_kx8(grp, q, b0, NB, P, out))
DEFINE_X8_LINEAR_ROWS(linear_rows_q6_kx8, 256, 0, dot_q6_kx8(grp, q, b0, NB, P, out))
#endif

/* dst = the n x k matrix src of a plain block format (named) interleaved by 8 rows (n a multiple
 * of 8). Returns 0, or 1 for a format without an interleaved layout or a bad shape. */
int64_t repack_x8(const char *name, const uint8_t *src, int64_t n, int64_t k, uint8_t *dst) {
    /* the plain format's and its interleaved layout's rows of the table, and which block copy moves it */
    char x8_name[16];
    snprintf(x8_name, sizeof x8_name, "%sx8", name);
    const int64_t t = weight_type_index(name);
    if (t < 0 || weight_type_index(x8_name) < 0 || n <= 0 || n % IL != 0) return 1;
    const int64_t group = weight_types[t].block_size, bytes = weight_types[t].block_bytes;
    if (k <= 0 || k % group != 0) return 1;
    const int kq = group == 256, f = kq ? strcmp(name, "q6_k") == 0 : fmt32_of(name);
    const int64_t blocks = k / group, row_bytes = blocks * bytes;
    for (int64_t g = 0; g < n / IL; g++)
        for (int64_t i = 0; i < blocks; i++)
            for (int r = 0; r < IL; r++) {
                uint8_t *plain = (uint8_t *)src + (g * IL + r) * row_bytes + i * bytes, *x8 = dst + g * IL * row_bytes + i * IL * bytes;
                if (kq)
                    kx8_block(f, 1, plain, x8, r);
                else
                    x8_block((Fmt32)f, 1, plain, x8, r);
            }
    return 0;
}

/* ---- the table's row loops ---------------------------------------------------------------------
 * A format's LinearRows: every thread quantizes the input rows itself (a few thousand values at
 * decode, so no barrier is needed before the matmul), then takes its share of the weight rows. */
#define DEFINE_QUANT_LINEAR_ROWS(NAME, GROUP, DOT_CALL)                                                         \
    static inline __attribute__((always_inline)) void NAME##_dot(const uint8_t *w, const QuantRows *q, int64_t b0, \
                                                                const int NB, float *out) {                     \
        DOT_CALL;                                                                                                \
    }                                                                                                            \
    void NAME(const Linear *m, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy) {               \
        QuantRows q;                                                                                             \
        /* no scratch for the quantized rows: this thread's share is skipped, the caller reports it */     \
        const int no_rows = quantize_rows(x, ldx, rows, m->k, GROUP, 0, input_mode(m), &q);                     \
        if (no_rows) note_kernel_failure();                                                                      \
        _Pragma("omp for schedule(static) nowait") for (int64_t r = 0; r < m->n; r++) {                          \
            if (no_rows) continue;                                                                               \
            const uint8_t *w = (const uint8_t *)m->data + r * m->row_bytes;                                      \
            for (int64_t b0 = 0; b0 < rows; b0 += QROWS) {                                                       \
                float dot[QROWS];                                                                                \
                switch (rows - b0 < QROWS ? rows - b0 : QROWS) {                                                 \
                case 1: NAME##_dot(w, &q, b0, 1, dot); break;                                                    \
                case 2: NAME##_dot(w, &q, b0, 2, dot); break;                                                    \
                case 3: NAME##_dot(w, &q, b0, 3, dot); break;                                                    \
                default: NAME##_dot(w, &q, b0, 4, dot); break;                                                   \
                }                                                                                                \
                const int64_t nb = rows - b0 < QROWS ? rows - b0 : QROWS;                                        \
                for (int64_t b = 0; b < nb; b++) y[(b0 + b) * ldy + r] = dot[b] + (m->bias != NULL ? m->bias[r] : 0.0f); \
            }                                                                                                    \
        }                                                                                                        \
    }

DEFINE_QUANT_LINEAR_ROWS(linear_rows_q8_0, 32, dot_fmt32(FMT_Q8_0, w, q, b0, NB, out))
DEFINE_QUANT_LINEAR_ROWS(linear_rows_q4_0, 32, dot_fmt32(FMT_Q4_0, w, q, b0, NB, out))
DEFINE_QUANT_LINEAR_ROWS(linear_rows_q4_1, 32, dot_fmt32(FMT_Q4_1, w, q, b0, NB, out))
DEFINE_QUANT_LINEAR_ROWS(linear_rows_q5_0, 32, dot_fmt32(FMT_Q5_0, w, q, b0, NB, out))
DEFINE_QUANT_LINEAR_ROWS(linear_rows_q5_1, 32, dot_fmt32(FMT_Q5_1, w, q, b0, NB, out))
DEFINE_QUANT_LINEAR_ROWS(linear_rows_q4_k, 256, dot_q4_k(w, q, b0, NB, out))
DEFINE_QUANT_LINEAR_ROWS(linear_rows_q6_k, 256, dot_q6_k(w, q, b0, NB, out))

void to_f32_q8_0(const Linear *m, int64_t r, float *out) { to_f32_fmt32(FMT_Q8_0, m, r, out); }
void to_f32_q4_0(const Linear *m, int64_t r, float *out) { to_f32_fmt32(FMT_Q4_0, m, r, out); }
void to_f32_q4_1(const Linear *m, int64_t r, float *out) { to_f32_fmt32(FMT_Q4_1, m, r, out); }
void to_f32_q5_0(const Linear *m, int64_t r, float *out) { to_f32_fmt32(FMT_Q5_0, m, r, out); }
void to_f32_q5_1(const Linear *m, int64_t r, float *out) { to_f32_fmt32(FMT_Q5_1, m, r, out); }

/* ---- f16: fp32 inputs, each weight vector widened once --------------------------------------- */
void to_f32_f16(const Linear *m, int64_t r, float *out) {
    const uint8_t *row = (const uint8_t *)m->data + r * m->row_bytes;
    for (int64_t i = 0; i < m->k; i++) out[i] = f16_to_f32(read_u16(row + 2 * i));
}

/* out[b] = f16 row w . x[b] (fp32), b < NB. */
static inline __attribute__((always_inline)) void dot_f16(const uint16_t *w, const float *x, int64_t ldx, int64_t k,
                                                         const int NB, float *out) {
    int64_t i = 0;
    float s[QROWS] = {0};
#if QUANT_SIMD
    __m256 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();
    for (; i + 8 <= k; i += 8) {
        const __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i)));
        for (int b = 0; b < NB; b++) acc[b] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + b * ldx + i), acc[b]);
    }
    for (int b = 0; b < NB; b++) s[b] = hsum_ps(acc[b]);
#endif
    for (; i < k; i++)
        for (int b = 0; b < NB; b++) s[b] += f16_to_f32(w[i]) * x[b * ldx + i];
    for (int b = 0; b < NB; b++) out[b] = s[b];
}

/* ---- e4m3: fp8 weights (float8_e4m3fn) in blocks of 32 behind an fp32 scale --------------------
 * A block (36 bytes) is the fp32 scale times 2^8, then 32 e4m3 bytes. An e4m3 byte's sign bit moved
 * to bit 15 and its exponent and mantissa bits shifted up by 7 make the fp16 of the same value times
 * 2^-8 (fp16's exponent bias is 8 more than e4m3's; subnormals map onto subnormals), which F16C
 * widens; the stored scale's 2^8 undoes the 2^-8. So a weight is d * value, rounded once, as
 * `weight.float() * scale` is. Inputs stay fp32: fp8 values share no integer grid within a block. */
static inline uint16_t e4m3_as_f16(uint8_t b) { return (uint16_t)(((b & 0x80) << 8) | ((b & 0x7F) << 7)); }

void to_f32_e4m3(const Linear *m, int64_t r, float *out) {
    const uint8_t *row = (const uint8_t *)m->data + r * m->row_bytes;
    for (int64_t i = 0; i < m->k; i += 32, row += 36) {
        float d;
        memcpy(&d, row, sizeof d);
        for (int j = 0; j < 32; j++) out[i + j] = d * f16_to_f32(e4m3_as_f16(row[4 + j]));
    }
}

/* out[b] = e4m3 row w . x[b] (fp32), b < NB: per block, the 32 products summed, then scaled. */
static inline __attribute__((always_inline)) void dot_e4m3(const uint8_t *w, const float *x, int64_t ldx, int64_t k,
                                                          const int NB, float *out) {
    float s[QROWS] = {0};
#if QUANT_SIMD
    __m256 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();
    const __m128i sign = _mm_set1_epi16(0x80), mag = _mm_set1_epi16(0x7F);
    for (int64_t i = 0; i < k; i += 32, w += 36) {
        float d;
        memcpy(&d, w, sizeof d);
        __m256 part[QROWS];
        for (int b = 0; b < NB; b++) part[b] = _mm256_setzero_ps();
        for (int c = 0; c < 4; c++) {
            const __m128i v = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(w + 4 + 8 * c)));
            const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(v, sign), 8),
                                           _mm_slli_epi16(_mm_and_si128(v, mag), 7));
            const __m256 wv = _mm256_cvtph_ps(h);
            for (int b = 0; b < NB; b++) part[b] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + b * ldx + i + 8 * c), part[b]);
        }
        const __m256 dv = _mm256_set1_ps(d);
        for (int b = 0; b < NB; b++) acc[b] = _mm256_fmadd_ps(part[b], dv, acc[b]);
    }
    for (int b = 0; b < NB; b++) s[b] = hsum_ps(acc[b]);
#else
    for (int64_t i = 0; i < k; i += 32, w += 36) {
        float d;
        memcpy(&d, w, sizeof d);
        for (int b = 0; b < NB; b++) {
            float p = 0.0f;
            for (int j = 0; j < 32; j++) p += f16_to_f32(e4m3_as_f16(w[4 + j])) * x[b * ldx + i + j];
            s[b] += d * p;
        }
    }
#endif
    for (int b = 0; b < NB; b++) out[b] = s[b];
}

/* The row loop of a format whose inputs stay fp32 (f16, e4m3): DOT(w, xb, ldx, k, NB, dot) on up
 * to QROWS input rows per pass over a weight row. */
#define DEFINE_FLOAT_LINEAR_ROWS(NAME, WTYPE, DOT)                                                              \
    void NAME(const Linear *m, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy) {              \
        _Pragma("omp for schedule(static) nowait") for (int64_t r = 0; r < m->n; r++) {                         \
            const WTYPE *w = (const WTYPE *)((const uint8_t *)m->data + r * m->row_bytes);                      \
            for (int64_t b0 = 0; b0 < rows; b0 += QROWS) {                                                      \
                float dot[QROWS];                                                                               \
                const float *xb = x + b0 * ldx;                                                                 \
                const int64_t nb = rows - b0 < QROWS ? rows - b0 : QROWS;                                       \
                switch (nb) {                                                                                   \
                case 1: DOT(w, xb, ldx, m->k, 1, dot); break;                                                   \
                case 2: DOT(w, xb, ldx, m->k, 2, dot); break;                                                   \
                case 3: DOT(w, xb, ldx, m->k, 3, dot); break;                                                   \
                default: DOT(w, xb, ldx, m->k, 4, dot); break;                                                  \
                }                                                                                               \
                for (int64_t b = 0; b < nb; b++) y[(b0 + b) * ldy + r] = dot[b] + (m->bias != NULL ? m->bias[r] : 0.0f); \
            }                                                                                                   \
        }                                                                                                       \
    }

DEFINE_FLOAT_LINEAR_ROWS(linear_rows_f16, uint16_t, dot_f16)
DEFINE_FLOAT_LINEAR_ROWS(linear_rows_e4m3, uint8_t, dot_e4m3)

/* 1 where this build multiplies with the AVX2 vector code, 0 for the plain C one. */
int64_t quant_simd(void) { return QUANT_SIMD; }
