/* Block-quantized weight formats (GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K, MXFP4), f16 and e4m3, as
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
 * and the reference the tests compare the vector code with: same integer sums). This file holds the
 * layouts, the conversions and the row loops; the kernels are in one file per instruction set,
 * included below ("the kernels by instruction set"). */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

#define QUANT_SIMD (ISA_AVX2 && ISA_FMA && ISA_F16C)
/* 256-bit integer dot products with accumulation (vpdpbusd): AVX512-VNNI or AVX-VNNI */
#define QUANT_VNNI (QUANT_SIMD && ISA_VNNI256)
/* The interleaved Q8_0 kernel multiplies X itself (int16) rather than its two int8 planes, with its
 * weights interleaved in pairs rather than in 4-value chunks (see the layouts below) */
#define Q8_0_X16 (QUANT_SIMD && !QUANT_VNNI)
/* 512-bit vpdpbusd: the interleaved 32-weight formats multiply two 8-row groups at once (one row per
 * 32-bit lane of a zmm register), half the instructions per product of the 256-bit kernel, for
 * less than twice a ymm vpdpbusd's cost (docs/performance.md, "Block formats in C") */
#define QUANT_VNNI512 (QUANT_VNNI && ISA_AVX512VNNI && ISA_AVX512BW)

#define QROWS 4 /* input rows multiplied per pass over a weight row */

static inline uint16_t read_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* IEEE half -> float (subnormals, infinities and NaNs included): F16C's instruction, or the plain
 * C conversion (the per-instruction-set definitions below). */
static inline float f16_to_f32(uint16_t h);

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
 * answers are the two planes' (docs/performance.md, "Input rounding"); the interleaved kernels skip the low
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
    /* [rows][k / 32], [rows][k / 16]: the sums of each 32 and each 16 consecutive X in fp32 (group-256
     * formats, else NULL): what Q4_K's mins and Q6_K's offsets multiply */
    const float *s32, *s16f;
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

/* One input row quantized (the plain C reference is always compiled, the build of CPUs without
 * AVX2 and the oracle quantize_row_matches_reference checks the vector body against; the AVX2 +
 * FMA + F16C one where the CPU has them): hr, lr, d, two, sums are the row's own. */
static void quantize_row_ref(const float *xr, int64_t k, int64_t group, int mode, int8_t *hr, int8_t *lr,
                             int16_t *xr16, float *d, uint8_t *two, int32_t *sums);
#if QUANT_SIMD
static void quantize_row_avx2(const float *xr, int64_t k, int64_t group, int mode, int8_t *hr, int8_t *lr,
                              int16_t *xr16, float *d, uint8_t *two, int32_t *sums);
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
    const int k_sums = group == 256; /* (q->s32, q->s16f) */
    const size_t need = (size_t)rows * ((with_x16 ? 4 : 2) * (size_t)k + 3 * sizeof(float) * (size_t)groups +
                                        sizeof(int32_t) * (size_t)sixteens + (size_t)groups +
                                        (k_sums ? sizeof(float) * (size_t)(k / 32 + sixteens) : 0)) + 64;
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
    float *s32 = k_sums ? ds + rows * groups : NULL, *s16f = k_sums ? s32 + rows * (k / 32) : NULL;
    for (int64_t r = r0; r < r1; r++) {
        quantize_row(x + r * ldx, k, group, mode, hi + r * k, lo + r * k, with_x16 ? x16 + r * k : NULL,
                     d + r * groups, two + r * groups, sums + r * sixteens);
        group_scales(r, groups, group, d, sums, dh, ds);
        if (k_sums) {
            for (int64_t j = 0; j < k / 32; j++) s32[r * (k / 32) + j] = (float)(sums[r * sixteens + 2 * j] + sums[r * sixteens + 2 * j + 1]);
            for (int64_t j = 0; j < sixteens; j++) s16f[r * sixteens + j] = (float)sums[r * sixteens + j];
        }
    }
    if (shared) {
#pragma omp barrier
    }
    *q = (QuantRows){hi, lo, d, sums, x16, two, dh, ds, k, group, s32, s16f};
    return 0;
}

/* X of input value j of a row (plain C paths). */
static inline int32_t x_at(const int8_t *hi, const int8_t *lo, int64_t j) { return 127 * hi[j] + lo[j]; }


/* ---- the 32-weight formats -----------------------------------------------------------------------
 * Each block: an fp16 scale d (and for Q4_1 / Q5_1 an fp16 min m), then the values:
 *   Q8_0 (34 bytes): int8 q[32];                          w = d q
 *   Q4_0 (18): nibbles[16] (low: values 0-15, high: 16-31); w = d (q - 8)
 *   Q4_1 (20): d, m, nibbles[16];                         w = d q + m
 *   Q5_0 (22): d, fifth bits[4], nibbles[16];              w = d (q - 16)
 *   Q5_1 (24): d, m, fifth bits[4], nibbles[16];           w = d q + m
 *   MXFP4 (17): an E8M0 exponent e, nibbles[16] (Q4_0's order) of FP4 E2M1 codes;
 *               w = 2^(e - 128) kv[q], kv the E2M1 values doubled: 0 1 2 3 4 6 8 12, then negated
 * The dot of a block with an input group (scale dx, values x, sum S) is
 *   d dx (sum q x) - offset d dx S   or   d dx (sum q x) + m dx S.
 * MXFP4's codes are not linear in q: each nibble is looked up (vpshufb) as kv[q] + 12, an unsigned
 * 0..24, so that it multiplies like Q4_0's values with an offset of 12. */
typedef enum { FMT_Q8_0, FMT_Q4_0, FMT_Q4_1, FMT_Q5_0, FMT_Q5_1, FMT_MXFP4 } Fmt32;

/* Per Fmt32 (constant-folded where f is a constant): bytes per block, whether it has a min, the
 * offset its stored values carry, its name in the table. */
static const int FMT32_BYTES[] = {34, 18, 20, 22, 24, 17}, FMT32_MIN[] = {0, 0, 1, 0, 1, 0},
                 FMT32_OFFSET[] = {0, 8, 0, 16, 0, 12};
static const char *const FMT32_NAMES[] = {"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4"};
static inline int fmt_bytes(Fmt32 f) { return FMT32_BYTES[f]; }
static inline int fmt_has_min(Fmt32 f) { return FMT32_MIN[f]; }
static inline int fmt_offset(Fmt32 f) { return FMT32_OFFSET[f]; }
/* Bytes of a block's scale (fp16 d, or MXFP4's one exponent byte). */
static inline int fmt_scale_bytes(Fmt32 f) { return f == FMT_MXFP4 ? 1 : 2; }

/* MXFP4's E2M1 codes doubled, plus 12 (unsigned 0..24): the units its nibbles are looked up as. */
static const uint8_t MXFP4_UNITS[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

/* 2^(e - 128): an E8M0 exponent's scale, halved for the doubled codes (exact: e < 2 subnormal). */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* A 32-weight block's scale d. */
static inline float fmt_scale(Fmt32 f, const uint8_t *blk) {
    return f == FMT_MXFP4 ? e8m0_half(blk[0]) : f16_to_f32(read_u16(blk));
}

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
    if (f == FMT_MXFP4) {
        for (int j = 0; j < 16; j++) q[j] = MXFP4_UNITS[blk[1 + j] & 0x0F], q[j + 16] = MXFP4_UNITS[blk[1 + j] >> 4];
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
    const float *s32[QROWS], *s16f[QROWS];
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
        in.s32[b] = q->s32 != NULL ? q->s32 + (b0 + b) * (q->k / 32) : NULL;
        in.s16f[b] = q->s16f != NULL ? q->s16f + (b0 + b) * sixteens : NULL;
    }
    return in;
}

static void to_f32_fmt32(Fmt32 f, const Linear *m, int64_t r, float *out) {
    const uint8_t *row = (const uint8_t *)m->data + r * m->row_bytes;
    for (int64_t i = 0; i < m->k / 32; i++) {
        const uint8_t *blk = row + i * fmt_bytes(f);
        const float d = fmt_scale(f, blk), mn = fmt_has_min(f) ? f16_to_f32(read_u16(blk + 2)) : 0.0f;
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
 *   q8_0x8 (272 bytes): d[8], then 8 chunks of values 4c..4c+3; where Q8_0_X16 (AVX2 without VNNI,
 *          whose kernel widens the values to int16 for vpmaddwd) 16 chunks of values 2c, 2c + 1 at
 *          byte 16 c + 2 r instead: one chunk widened is then 8 rows' pairs, and a broadcast input
 *          pair times it gives the 8 rows' sums in 8 lanes
 *   q4_0x8 (144): d[8], then 4 chunks of the stored nibble bytes 4c..4c+3 (low nibbles: values
 *          4c..4c+3, high: 16 + 4c..)                            q4_1x8 (160): d[8], m[8], nibbles
 *   q5_0x8 (176): d[8], fifth bits[8] (a 32-bit word per row, bit 8 t + c: value 4 c + t), nibbles
 *   q5_1x8 (192): d[8], m[8], fifth bits[8], nibbles
 *   mxfp4x8 (136): e[8], then q4_0x8's nibbles */
#define IL 8

static inline int fmt_scales_bytes(Fmt32 f) { return fmt_has_min(f) ? 4 * IL : fmt_scale_bytes(f) * IL; }

/* Copy row `lane`'s block between the plain layout (plain) and a group's interleaved block (x8):
 * to_x8 1 repacks, 0 unpacks. */
static void x8_block(Fmt32 f, int to_x8, uint8_t *plain, uint8_t *x8, int lane) {
    const int sb = fmt_scale_bytes(f), heads = fmt_has_min(f) ? 4 : sb;
    for (int h = 0; h < heads; h += sb) { /* d (and m) */
        uint8_t *a = plain + h, *b = x8 + h * IL + sb * lane;
        memcpy(to_x8 ? b : a, to_x8 ? a : b, (size_t)sb);
    }
    uint8_t *values = x8 + fmt_scales_bytes(f);
    if (f == FMT_Q8_0) {
        const int w = Q8_0_X16 ? 2 : 4; /* bytes a chunk takes of each row */
        for (int c = 0; c < 32 / w; c++) memcpy(to_x8 ? values + IL * w * c + w * lane : plain + 2 + w * c,
                                                to_x8 ? plain + 2 + w * c : values + IL * w * c + w * lane, (size_t)w);
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

/* (the x8 layouts' row loops and repack_x8 follow the K-quants' interleaved kernels, below) */
void to_f32_q8_0x8(const Linear *m, int64_t r, float *out) { to_f32_fmt32x8(FMT_Q8_0, m, r, out); }
void to_f32_q4_0x8(const Linear *m, int64_t r, float *out) { to_f32_fmt32x8(FMT_Q4_0, m, r, out); }
void to_f32_q4_1x8(const Linear *m, int64_t r, float *out) { to_f32_fmt32x8(FMT_Q4_1, m, r, out); }
void to_f32_q5_0x8(const Linear *m, int64_t r, float *out) { to_f32_fmt32x8(FMT_Q5_0, m, r, out); }
void to_f32_q5_1x8(const Linear *m, int64_t r, float *out) { to_f32_fmt32x8(FMT_Q5_1, m, r, out); }
void to_f32_mxfp4x8(const Linear *m, int64_t r, float *out) { to_f32_fmt32x8(FMT_MXFP4, m, r, out); }

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
 *          Q4_0's and Q8_0's rate (docs/performance.md, "Block formats in C"). */
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

/* ---- f16: fp32 inputs, each weight vector widened once --------------------------------------- */
void to_f32_f16(const Linear *m, int64_t r, float *out) {
    const uint8_t *row = (const uint8_t *)m->data + r * m->row_bytes;
    for (int64_t i = 0; i < m->k; i++) out[i] = f16_to_f32(read_u16(row + 2 * i));
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

/* ---- the kernels by instruction set ------------------------------------------------------------
 * The plain C reference (always compiled: quantize_row_ref is the oracle of every build; its kernels
 * where QUANT_SIMD is 0), the AVX2 + FMA + F16C baseline, its VNNI replacements, and the 512-bit
 * kernels. Each file holds one instruction set; cpu_quant.c holds the layouts and the row loops. */
#include "cpu_quant_ref.h"
#if QUANT_SIMD
#include "cpu_quant_avx2.h"
#endif
#if QUANT_VNNI
#include "cpu_quant_vnni.h"
#endif
#if QUANT_VNNI512
#include "cpu_quant_vnni512.h"
#endif


/* An interleaved format's LinearRows: the inputs quantized in groups of GROUP (X16: also kept in
 * int16), then each thread takes its share of the 8-row groups (W = 16 and at least X16_MIN_ROWS
 * input rows: of the pairs of groups, a last odd group on its own), QROWS input rows per pass.
 * X16_MIN_ROWS: a pair is read as two forward streams, which a Zen 4 core (zmm as two 256-bit
 * halves) fetches from memory slower than one group's single stream; at a few rows, bound by
 * those bytes, single groups win, and from 8 rows on the pairs' arithmetic does
 * (docs/performance.md, "Block formats in C"). */
#define X16_MIN_ROWS 8
/* Input rows per pass over the weights: their quantized bytes within ROW_BLOCK_BYTES (of L2), so that
 * a long prefill reads them from L2 for every weight group, where all of 8192 rows' (8-25 MB) came
 * from memory each time; the weights are read once per block instead (docs/performance.md, "Block formats in C"). */
#define ROW_BLOCK_BYTES (256 * 1024)
#define ROW_BLOCK_MIN 128 /* up to here the rows stay one block (a short prompt: its weights read once) */
static inline int64_t row_block(const QuantRows *q, int64_t rows, int failed) {
    if (failed || rows <= ROW_BLOCK_MIN) return rows;
    const int64_t per_row = q->k * (q->x16 != NULL ? 4 : 2) + 16 * (q->k / q->group);
    const int64_t rb = ROW_BLOCK_BYTES / per_row / QROWS * QROWS;
    return rb < 4 * QROWS ? 4 * QROWS : rb;
}
#define X8_PASS(NAME, W, grp, gb, b0, dot)                                                                   \
    switch ((end - b0 < QROWS ? end - b0 : QROWS) + (one ? QROWS : 0)) {                                     \
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
        const int64_t rb = row_block(&q, rows, no_rows);                                                         \
        for (int64_t r0 = 0; r0 < rows; r0 += rb) {                                                              \
        const int64_t end = r0 + rb < rows ? r0 + rb : rows;                                                     \
        _Pragma("omp for schedule(static) nowait") for (int64_t u = 0; u < units; u++) {                         \
            if (no_rows) continue;                                                                               \
            const int64_t g = pairs ? 2 * u : u;                                                                 \
            const uint8_t *grp = group_of(m, g);                                                                 \
            const int wide = pairs && g + 1 < groups, width = wide ? 2 * IL : IL;                                \
            for (int64_t b0 = r0; b0 < end; b0 += QROWS) {                                                       \
                const int64_t nb = end - b0 < QROWS ? end - b0 : QROWS;                                          \
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
/* (no 16-row VNNI-512 pairing for MXFP4: its units come out of a table lookup per 8-row group) */
DEFINE_X8_LINEAR_ROWS(linear_rows_mxfp4x8, 32, 0, dot_fmt32x8(FMT_MXFP4, grp, q, b0, NB, P, out))
#if QUANT_VNNI512
DEFINE_X8_LINEAR_ROWS_W(linear_rows_q4_kx8, 256, 0, dot_q4_kx8(grp, q, b0, NB, P, out), 16, dot_q4_kx16(grp, gb, q, b0, NB, P, out))
DEFINE_X8_LINEAR_ROWS_W(linear_rows_q6_kx8, 256, 0, dot_q6_kx8(grp, q, b0, NB, P, out), 16, dot_q6_kx16(grp, gb, q, b0, NB, P, out))
#else
DEFINE_X8_LINEAR_ROWS(linear_rows_q4_kx8, 256, 0, dot_q4_kx8(grp, q, b0, NB, P, out))
DEFINE_X8_LINEAR_ROWS(linear_rows_q6_kx8, 256, 0, dot_q6_kx8(grp, q, b0, NB, P, out))
#endif

/* dst = the n x k matrix src of a plain block format (named) interleaved by 8 rows (n a multiple
 * of 8); dst may be src (in place: each 8-row group goes through a buffer of its own bytes, so a
 * matrix is never held twice). Returns 0, or 1 for a format without an interleaved layout, a bad
 * shape or no memory for the buffer. */
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
    uint8_t *copy = src == dst ? malloc((size_t)(IL * row_bytes)) : NULL;
    if (src == dst && copy == NULL) return 1;
    for (int64_t g = 0; g < n / IL; g++) {
        const uint8_t *rows = src + g * IL * row_bytes;
        if (copy != NULL) rows = memcpy(copy, rows, (size_t)(IL * row_bytes));
        for (int64_t i = 0; i < blocks; i++)
            for (int r = 0; r < IL; r++) {
                uint8_t *plain = (uint8_t *)rows + r * row_bytes + i * bytes, *x8 = dst + g * IL * row_bytes + i * IL * bytes;
                if (kq)
                    kx8_block(f, 1, plain, x8, r);
                else
                    x8_block((Fmt32)f, 1, plain, x8, r);
            }
    }
    free(copy);
    return 0;
}

/* ---- the table's row loops ---------------------------------------------------------------------
 * A format's LinearRows: every thread quantizes the input rows itself (a few thousand values at
 * decode, so no barrier is needed before the matmul), then takes its share of the weight rows. */
#define DEFINE_QUANT_LINEAR_ROWS_WITH(NAME, GROUP, SCRATCH, ROW, DOT_CALL)                                       \
    static inline __attribute__((always_inline)) void NAME##_dot(const uint8_t *w, const void *ctx,              \
                                                                const QuantRows *q, int64_t b0, const int NB,    \
                                                                float *out) {                                    \
        (void)w, (void)ctx;                                                                                      \
        DOT_CALL;                                                                                                \
    }                                                                                                            \
    void NAME(const Linear *m, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy) {               \
        QuantRows q;                                                                                             \
        /* no scratch for the quantized rows: this thread's share is skipped, the caller reports it */     \
        int no_rows = quantize_rows(x, ldx, rows, m->k, GROUP, 0, input_mode(m), &q);                           \
        SCRATCH;                                                                                                 \
        if (no_rows) note_kernel_failure();                                                                      \
        const int64_t rb = row_block(&q, rows, no_rows);                                                         \
        for (int64_t r0 = 0; r0 < rows; r0 += rb) {                                                              \
        const int64_t end = r0 + rb < rows ? r0 + rb : rows;                                                     \
        _Pragma("omp for schedule(static) nowait") for (int64_t r = 0; r < m->n; r++) {                          \
            if (no_rows) continue;                                                                               \
            const uint8_t *w = (const uint8_t *)m->data + r * m->row_bytes;                                      \
            const void *ctx = NULL;                                                                              \
            ROW;                                                                                                 \
            for (int64_t b0 = r0; b0 < end; b0 += QROWS) {                                                       \
                float dot[QROWS];                                                                                \
                switch (end - b0 < QROWS ? end - b0 : QROWS) {                                                   \
                case 1: NAME##_dot(w, ctx, &q, b0, 1, dot); break;                                               \
                case 2: NAME##_dot(w, ctx, &q, b0, 2, dot); break;                                               \
                case 3: NAME##_dot(w, ctx, &q, b0, 3, dot); break;                                               \
                default: NAME##_dot(w, ctx, &q, b0, 4, dot); break;                                              \
                }                                                                                                \
                const int64_t nb = end - b0 < QROWS ? end - b0 : QROWS;                                          \
                for (int64_t b = 0; b < nb; b++) y[(b0 + b) * ldy + r] = dot[b] + (m->bias != NULL ? m->bias[r] : 0.0f); \
            }                                                                                                    \
        }                                                                                                        \
        }                                                                                                        \
    }
/* SCRATCH: per call, after the inputs are quantized (may set no_rows); ROW: per weight row w (may
 * point ctx at what DOT_CALL reads). */
#define DEFINE_QUANT_LINEAR_ROWS(NAME, GROUP, DOT_CALL) DEFINE_QUANT_LINEAR_ROWS_WITH(NAME, GROUP, (void)0, (void)0, DOT_CALL)

DEFINE_QUANT_LINEAR_ROWS(linear_rows_q8_0, 32, dot_fmt32(FMT_Q8_0, w, q, b0, NB, out))
DEFINE_QUANT_LINEAR_ROWS(linear_rows_q4_0, 32, dot_fmt32(FMT_Q4_0, w, q, b0, NB, out))
DEFINE_QUANT_LINEAR_ROWS(linear_rows_q4_1, 32, dot_fmt32(FMT_Q4_1, w, q, b0, NB, out))
DEFINE_QUANT_LINEAR_ROWS(linear_rows_q5_0, 32, dot_fmt32(FMT_Q5_0, w, q, b0, NB, out))
DEFINE_QUANT_LINEAR_ROWS(linear_rows_q5_1, 32, dot_fmt32(FMT_Q5_1, w, q, b0, NB, out))
DEFINE_QUANT_LINEAR_ROWS(linear_rows_mxfp4, 32, dot_fmt32(FMT_MXFP4, w, q, b0, NB, out))
DEFINE_QUANT_LINEAR_ROWS(linear_rows_q4_k, 256, dot_q4_k(w, q, b0, NB, out))
DEFINE_QUANT_LINEAR_ROWS(linear_rows_q6_k, 256, dot_q6_k(w, q, b0, NB, out))

/* Q2_K, Q3_K, Q5_K, the IQ4s and the grid i-quants: their blocks decoded once per pass */
#include "cpu_quant_decoded.h"

void to_f32_q8_0(const Linear *m, int64_t r, float *out) { to_f32_fmt32(FMT_Q8_0, m, r, out); }
void to_f32_q4_0(const Linear *m, int64_t r, float *out) { to_f32_fmt32(FMT_Q4_0, m, r, out); }
void to_f32_q4_1(const Linear *m, int64_t r, float *out) { to_f32_fmt32(FMT_Q4_1, m, r, out); }
void to_f32_q5_0(const Linear *m, int64_t r, float *out) { to_f32_fmt32(FMT_Q5_0, m, r, out); }
void to_f32_q5_1(const Linear *m, int64_t r, float *out) { to_f32_fmt32(FMT_Q5_1, m, r, out); }
void to_f32_mxfp4(const Linear *m, int64_t r, float *out) { to_f32_fmt32(FMT_MXFP4, m, r, out); }

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
