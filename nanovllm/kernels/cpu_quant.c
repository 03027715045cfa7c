/* Block-quantized weight formats (GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K) and f16, as
 * rows of the weight-type table (cpu_kernels.c).
 *
 * A quantized matrix is held as the file stores it: n rows of k / block_size blocks each (the
 * block layouts are llama.cpp's, ggml-common.h). y = x W^T is computed in integers: every input row
 * is quantized once per call to int8 in groups (32 values for the 32-weight formats, 256 for the
 * K-quants, one fp32 scale each, plus the sum of every 16 quantized values), and each block's dot
 * product is an int8 x int8 / uint8 sum (AVX2 vpmaddubsw + vpmaddwd, or VNNI's vpdpbusd), scaled
 * once per block (per 256 for the K-quants, whose 6-bit sub-block scales multiply in integers).
 * Offsets (Q4_0's -8, Q4_1's min, Q6_K's -32, Q4_K's mins) come out of the precomputed group sums,
 * not out of the weights, so the 4- and 6-bit values multiply as they are stored.
 *
 * Each weight row is read once per call and multiplied into up to QROWS input rows at a time
 * (unpacked once for all of them); more input rows (prefill) reread the row from L1.
 * The AVX2 + FMA + F16C code is the baseline; each format also has a plain C version (other CPUs,
 * and the reference the tests compare the vector code with: same integer sums). */
#include <math.h>
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

#define QROWS 4 /* input rows multiplied per pass over a weight row */

static inline uint16_t read_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* IEEE half -> float (subnormals, infinities and NaNs included). */
static inline float f16_to_f32(uint16_t h) {
#if QUANT_SIMD
    return _cvtsh_ss(h);
#else
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
#endif
}

float nanovllm_f16_to_f32(uint16_t h) { return f16_to_f32(h); }

/* ---- input rows quantized to int8 ------------------------------------------------------------- */
typedef struct {
    const int8_t *qs;     /* [rows][k] */
    const float *d;       /* [rows][k / group]: value = d * q */
    const int16_t *sums;  /* [rows][k / 16]: sum of each 16 consecutive q */
    int64_t k, group;
} QuantRows;

/* One thread's buffer for the quantized rows, grown as needed and kept for its next calls. */
static _Thread_local void *quant_buffer;
static _Thread_local size_t quant_capacity;

/* x [rows, k] (row stride ldx) quantized in groups of `group` values (k a multiple of group and
 * of 16): d = max |x| / 127, q = round(x / d). Returns 0, or 1 when the buffer cannot be had. */
static int quantize_rows(const float *x, int64_t ldx, int64_t rows, int64_t k, int64_t group, QuantRows *q) {
    const int64_t groups = k / group, sixteens = k / 16;
    const size_t need = (size_t)rows * ((size_t)k + sizeof(float) * (size_t)groups + sizeof(int16_t) * (size_t)sixteens) + 64;
    if (need > quant_capacity) {
        void *grown = realloc(quant_buffer, need);
        if (grown == NULL) return 1;
        quant_buffer = grown, quant_capacity = need;
    }
    float *d = quant_buffer;
    int16_t *sums = (int16_t *)(d + rows * groups);
    int8_t *qs = (int8_t *)(sums + rows * sixteens);
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = xr + g * group;
            float amax = 0.0f;
            for (int64_t i = 0; i < group; i++) amax = fmaxf(amax, fabsf(xg[i]));
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            d[r * groups + g] = amax / 127.0f;
            int8_t *qg = qs + r * k + g * group;
            for (int64_t i = 0; i < group; i++) {
                const float v = nearbyintf(xg[i] * inv);
                qg[i] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
            }
        }
        for (int64_t s = 0; s < sixteens; s++) {
            int32_t sum = 0;
            for (int i = 0; i < 16; i++) sum += qs[r * k + s * 16 + i];
            sums[r * sixteens + s] = (int16_t)sum;
        }
    }
    *q = (QuantRows){qs, d, sums, k, group};
    return 0;
}


/* ---- vector helpers --------------------------------------------------------------------------- */
#if QUANT_SIMD
/* 8 int32 sums of u (unsigned bytes) x s (signed bytes), 4 products each. NOTE: vpmaddubsw
 * saturates a pair's sum at int16: every caller keeps |u| * |s| * 2 <= 128 * 127 * 2. */
static inline __m256i dot_us(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

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

static inline int fmt_bytes(Fmt32 f) { return f == FMT_Q8_0 ? 34 : f == FMT_Q4_0 ? 18 : f == FMT_Q4_1 ? 20 : f == FMT_Q5_0 ? 22 : 24; }
static inline int fmt_has_min(Fmt32 f) { return f == FMT_Q4_1 || f == FMT_Q5_1; }
static inline int fmt_offset(Fmt32 f) { return f == FMT_Q4_0 ? 8 : f == FMT_Q5_0 ? 16 : 0; }

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
    const int8_t *qs[QROWS];
    const float *d[QROWS];
    const int16_t *sums[QROWS];
} InputRows;

static inline __attribute__((always_inline)) InputRows input_rows(const QuantRows *q, int64_t b0, const int NB) {
    InputRows in;
    const int64_t groups = q->k / q->group, sixteens = q->k / 16;
    for (int b = 0; b < NB; b++) {
        in.qs[b] = q->qs + (b0 + b) * q->k;
        in.d[b] = q->d + (b0 + b) * groups;
        in.sums[b] = q->sums + (b0 + b) * sixteens;
    }
    return in;
}

/* out[b] = row w . input row b0 + b, for b < NB. */
static inline __attribute__((always_inline)) void dot_fmt32(Fmt32 f, const uint8_t *w, const QuantRows *q, int64_t b0,
                                                           const int NB, float *out) {
    const int64_t blocks = q->k / 32, bytes = fmt_bytes(f);
    const InputRows in = input_rows(q, b0, NB);
    float corr[QROWS] = {0};
#if QUANT_SIMD
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
            const __m256i xv = load_i8(in.qs[b] + i * 32);
            const float dx = in.d[b][i];
            __m256i p = dot_us(aw, f == FMT_Q8_0 ? _mm256_sign_epi8(xv, wv) : xv);
            const int32_t s32 = (int32_t)in.sums[b][2 * i] + in.sums[b][2 * i + 1];
            if (fmt_offset(f)) /* sum (q - off) x = sum q x - off S: off / 8 * S off each of the 8 lanes */
                p = _mm256_sub_epi32(p, _mm256_set1_epi32(fmt_offset(f) / 8 * s32));
            acc[i & 1][b] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(p), acc[i & 1][b]);
            if (fmt_has_min(f)) corr[b] += m * dx * (float)s32;
        }
    }
    for (int b = 0; b < NB; b++) out[b] = hsum_ps(_mm256_add_ps(acc[0][b], acc[1][b])) + corr[b];
#else
    float acc[QROWS] = {0};
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *blk = w + i * bytes;
        const float d = f16_to_f32(read_u16(blk));
        const float m = fmt_has_min(f) ? f16_to_f32(read_u16(blk + 2)) : 0.0f;
        int32_t v[32];
        block32_values(f, blk, v);
        for (int b = 0; b < NB; b++) {
            const int8_t *x = in.qs[b] + i * 32;
            int32_t sum = 0;
            for (int j = 0; j < 32; j++) sum += v[j] * x[j];
            const float dx = in.d[b][i];
            const int32_t s32 = (int32_t)in.sums[b][2 * i] + in.sums[b][2 * i + 1];
            acc[b] += d * dx * (float)(sum - fmt_offset(f) * s32);
            if (fmt_has_min(f)) corr[b] += m * dx * (float)s32;
        }
    }
    for (int b = 0; b < NB; b++) out[b] = acc[b] + corr[b];
#endif
}

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

static inline __attribute__((always_inline)) void dot_q4_k(const uint8_t *w, const QuantRows *q, int64_t b0,
                                                          const int NB, float *out) {
    const int64_t supers = q->k / 256;
    const InputRows in = input_rows(q, b0, NB);
    float acc_s[QROWS] = {0}, corr[QROWS] = {0};
#if QUANT_SIMD
    __m256 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();
#endif
    for (int64_t i = 0; i < supers; i++) {
        const uint8_t *blk = w + i * 144;
        const float d = f16_to_f32(read_u16(blk)), dmin = f16_to_f32(read_u16(blk + 2));
        uint8_t sc[8], mn[8];
        q4k_scales(blk + 4, sc, mn);
#if QUANT_SIMD
        __m256i sumi[QROWS];
        for (int b = 0; b < NB; b++) sumi[b] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i q4 = load_i8(blk + 16 + 32 * c);
            const __m256i lo = _mm256_and_si256(q4, _mm256_set1_epi8(0x0F));
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), _mm256_set1_epi8(0x0F));
            const __m256i s_lo = _mm256_set1_epi16(sc[2 * c]), s_hi = _mm256_set1_epi16(sc[2 * c + 1]);
            for (int b = 0; b < NB; b++) {
                const int8_t *x = in.qs[b] + i * 256 + 64 * c;
                sumi[b] = _mm256_add_epi32(sumi[b], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load_i8(x)), s_lo));
                sumi[b] = _mm256_add_epi32(sumi[b], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load_i8(x + 32)), s_hi));
            }
        }
#else
        int32_t v[256];
        q4k_values(blk, v);
#endif
        for (int b = 0; b < NB; b++) {
            const float dx = in.d[b][i];
            const int16_t *s16 = in.sums[b] + i * 16;
            int32_t msum = 0;
            for (int j = 0; j < 8; j++) msum += (int32_t)mn[j] * (s16[2 * j] + s16[2 * j + 1]);
            corr[b] -= dmin * dx * (float)msum;
#if QUANT_SIMD
            acc[b] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sumi[b]), acc[b]);
#else
            const int8_t *x = in.qs[b] + i * 256;
            int32_t sum = 0;
            for (int j = 0; j < 8; j++) {
                int32_t part = 0;
                for (int l = 0; l < 32; l++) part += v[32 * j + l] * x[32 * j + l];
                sum += (int32_t)sc[j] * part;
            }
            acc_s[b] += d * dx * (float)sum;
#endif
        }
    }
#if QUANT_SIMD
    for (int b = 0; b < NB; b++) acc_s[b] = hsum_ps(acc[b]);
#endif
    for (int b = 0; b < NB; b++) out[b] = acc_s[b] + corr[b];
}

static inline __attribute__((always_inline)) void dot_q6_k(const uint8_t *w, const QuantRows *q, int64_t b0,
                                                          const int NB, float *out) {
    const int64_t supers = q->k / 256;
    const InputRows in = input_rows(q, b0, NB);
    float acc_s[QROWS] = {0}, corr[QROWS] = {0};
#if QUANT_SIMD
    __m256 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();
#endif
    for (int64_t i = 0; i < supers; i++) {
        const uint8_t *blk = w + i * 210;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = f16_to_f32(read_u16(blk + 208));
#if QUANT_SIMD
        __m256i sumi[QROWS];
        for (int b = 0; b < NB; b++) sumi[b] = _mm256_setzero_si256();
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
                    const int8_t *x = in.qs[b] + i * 256 + 128 * h + 32 * t;
                    sumi[b] = _mm256_add_epi32(sumi[b], _mm256_madd_epi16(_mm256_maddubs_epi16(v[t], load_i8(x)), s));
                }
            }
        }
#else
        int32_t v[256];
        q6k_values(blk, v);
#endif
        for (int b = 0; b < NB; b++) {
            const float dx = in.d[b][i];
            const int16_t *s16 = in.sums[b] + i * 16;
            int32_t off = 0;
            for (int j = 0; j < 16; j++) off += (int32_t)sc[j] * s16[j];
            corr[b] -= 32.0f * d * dx * (float)off;
#if QUANT_SIMD
            acc[b] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sumi[b]), acc[b]);
#else
            const int8_t *x = in.qs[b] + i * 256;
            int32_t sum = 0;
            for (int j = 0; j < 16; j++) {
                int32_t part = 0;
                for (int l = 0; l < 16; l++) part += v[16 * j + l] * x[16 * j + l];
                sum += (int32_t)sc[j] * part;
            }
            acc_s[b] += d * dx * (float)sum;
#endif
        }
    }
#if QUANT_SIMD
    for (int b = 0; b < NB; b++) acc_s[b] = hsum_ps(acc[b]);
#endif
    for (int b = 0; b < NB; b++) out[b] = acc_s[b] + corr[b];
}

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
        if (quantize_rows(x, ldx, rows, m->k, GROUP, &q)) {                                                      \
            fprintf(stderr, "nanovllm: cannot allocate %lld quantized input rows\n", (long long)rows);           \
            abort();                                                                                             \
        }                                                                                                        \
        _Pragma("omp for schedule(static)") for (int64_t r = 0; r < m->n; r++) {                                 \
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

void linear_rows_f16(const Linear *m, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m->n; r++) {
        const uint16_t *w = (const uint16_t *)((const uint8_t *)m->data + r * m->row_bytes);
        for (int64_t b0 = 0; b0 < rows; b0 += QROWS) {
            float dot[QROWS];
            const float *xb = x + b0 * ldx;
            switch (rows - b0 < QROWS ? rows - b0 : QROWS) {
            case 1: dot_f16(w, xb, ldx, m->k, 1, dot); break;
            case 2: dot_f16(w, xb, ldx, m->k, 2, dot); break;
            case 3: dot_f16(w, xb, ldx, m->k, 3, dot); break;
            default: dot_f16(w, xb, ldx, m->k, 4, dot); break;
            }
            const int64_t nb = rows - b0 < QROWS ? rows - b0 : QROWS;
            for (int64_t b = 0; b < nb; b++) y[(b0 + b) * ldy + r] = dot[b] + (m->bias != NULL ? m->bias[r] : 0.0f);
        }
    }
}

/* 1 where this build multiplies with the AVX2 vector code, 0 for the plain C one. */
int64_t quant_simd(void) { return QUANT_SIMD; }
