/* The formats multiplied through a decoded block (included by cpu_quant.c after the per-instruction-
 * set bodies): Q2_K, Q3_K, Q5_K, IQ4_NL, IQ4_XS and the grid i-quants IQ2_XXS, IQ2_XS, IQ2_S,
 * IQ3_XXS, IQ3_S, IQ1_S, IQ1_M (the block layouts are ggml's, ggml-common.h; gguf.quants'
 * dequantizers are the tests' reference).
 *
 * Every one of them is, per sub-block of 16 weights, a signed 8-bit integer per weight times a
 * float scale, plus (Q2_K, Q5_K) a float min times the sub-block's input sum:
 *     w[16 j + e] = fs[j] v[16 j + e] + fm[j]
 * A block is decoded into that form once per pass over a weight row (v int8 [256], fs, fm [16]) and
 * multiplied into up to QROWS input rows, whose groups are the blocks (256, or IQ4_NL's 32): the
 * integer dot of each 16 v with the two input planes (AVX2: |v| x sign(x, v) by vpmaddubsw, each
 * 32 bytes two sub-blocks), then 127 hi + lo scaled by fs in fp32, and the mins from the input's
 * integer sums of 16. The i-quants' grids are installed from the gguf package at load
 * (set_quant_grid, from cpu_kernels.py); a table row of an i-quant without its grid is not valid.
 *
 * The IQ1 formats' delta (+-1/8 of the scale on a group of 8) is folded into the integers: w =
 * dl (g + delta) = dl / 8 (8 g +- 1), exact (a division by a power of two). */

typedef struct {
    int8_t v[256] __attribute__((aligned(32)));
    float fs[16], fm[16];
} Decoded;

typedef void (*DecodeBlock)(const uint8_t *blk, Decoded *o);

/* The IQ4 formats' 16 levels (IQ4_NL's kvalues). */
static const int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* The grids of the i-quants, by GridId: rows of `width` signed values, installed once. */
typedef enum { GRID_IQ2_XXS, GRID_IQ2_XS, GRID_IQ2_S, GRID_IQ3_XXS, GRID_IQ3_S, GRID_IQ1_S, NUM_GRIDS } GridId;
static const char *const GRID_NAMES[NUM_GRIDS] = {"iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s"};
static const int GRID_ROWS[NUM_GRIDS] = {256, 512, 1024, 256, 512, 2048}, GRID_WIDTH[NUM_GRIDS] = {8, 8, 8, 4, 4, 8};
static int8_t *grids[NUM_GRIDS];

static inline uint32_t read_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The sign byte of a 7-bit sign index: bit 7 makes the count of negatives even (ggml's ksigns). */
static inline uint8_t ksign(uint32_t i) { return (uint8_t)(i | ((uint32_t)(__builtin_popcount(i) & 1) << 7)); }

/* Eight values of a grid row, each negated where bit i of `signs` is set, at out. */
static inline void grid_row(GridId g, uint32_t index, uint8_t signs, int8_t *out) {
    const int8_t *row = grids[g] + (size_t)index * 8;
    for (int i = 0; i < 8; i++) out[i] = (signs >> i) & 1 ? (int8_t)-row[i] : row[i];
}

static void decode_q2_k(const uint8_t *blk, Decoded *o) {
    const uint8_t *sc = blk, *qs = blk + 16;
    const float d = f16_to_f32(read_u16(blk + 80)), dmin = f16_to_f32(read_u16(blk + 82));
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) o->v[128 * h + 32 * s + l] = (int8_t)((qs[32 * h + l] >> (2 * s)) & 3);
    for (int j = 0; j < 16; j++) {
        o->fs[j] = d * (float)(sc[j] & 15);
        o->fm[j] = -dmin * (float)(sc[j] >> 4);
    }
}

static void decode_q3_k(const uint8_t *blk, Decoded *o) {
    const uint8_t *hmask = blk, *qs = blk + 32, *sc = blk + 96;
    const float d = f16_to_f32(read_u16(blk + 108));
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) {
                const int idx = 128 * h + 32 * s + l;
                const int high = (hmask[l] >> (idx / 32)) & 1; /* the value is 4 lower where the bit is clear */
                o->v[idx] = (int8_t)(((qs[32 * h + l] >> (2 * s)) & 3) - (high ? 0 : 4));
            }
    for (int j = 0; j < 16; j++) {
        const int low = (sc[j % 8] >> (4 * (j / 8))) & 15, high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
        o->fs[j] = d * (float)((low | (high << 4)) - 32);
        o->fm[j] = 0.0f;
    }
}

static void decode_q5_k(const uint8_t *blk, Decoded *o) {
    const float d = f16_to_f32(read_u16(blk)), dmin = f16_to_f32(read_u16(blk + 2));
    const uint8_t *qh = blk + 16, *qs = blk + 48;
    uint8_t sc[8], mn[8];
    q4k_scales(blk + 4, sc, mn);
    for (int c = 0; c < 4; c++)
        for (int a = 0; a < 2; a++)
            for (int l = 0; l < 32; l++) {
                const int idx = 64 * c + 32 * a + l;
                o->v[idx] = (int8_t)(((qs[32 * c + l] >> (4 * a)) & 15) | (((qh[l] >> (idx / 32)) & 1) << 4));
            }
    for (int j = 0; j < 16; j++) {
        o->fs[j] = d * (float)sc[j / 2];
        o->fm[j] = -dmin * (float)mn[j / 2];
    }
}

static void decode_iq4_nl(const uint8_t *blk, Decoded *o) {
    const float d = f16_to_f32(read_u16(blk));
    for (int l = 0; l < 16; l++) {
        o->v[l] = IQ4_LEVELS[blk[2 + l] & 15];
        o->v[16 + l] = IQ4_LEVELS[blk[2 + l] >> 4];
    }
    o->fs[0] = o->fs[1] = d;
    o->fm[0] = o->fm[1] = 0.0f;
}

static void decode_iq4_xs(const uint8_t *blk, Decoded *o) {
    const float d = f16_to_f32(read_u16(blk));
    const uint16_t sh = read_u16(blk + 2);
    const uint8_t *sl = blk + 4, *qs = blk + 8;
    for (int j = 0; j < 8; j++) {
        const int ls = (((sl[j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)) - 32;
        o->fs[2 * j] = o->fs[2 * j + 1] = d * (float)ls;
        o->fm[2 * j] = o->fm[2 * j + 1] = 0.0f;
        for (int l = 0; l < 16; l++) {
            o->v[32 * j + l] = IQ4_LEVELS[qs[16 * j + l] & 15];
            o->v[32 * j + 16 + l] = IQ4_LEVELS[qs[16 * j + l] >> 4];
        }
    }
}

/* The 4-bit scales of IQ2_XS / IQ2_S, one per 16 weights: d (0.5 + s) / 4. */
static inline void iq2_scales16(const uint8_t *scales, float d, Decoded *o) {
    for (int j = 0; j < 16; j++) {
        o->fs[j] = d * (0.5f + (float)((scales[j / 2] >> (4 * (j % 2))) & 15)) * 0.25f;
        o->fm[j] = 0.0f;
    }
}

static void decode_iq2_xxs(const uint8_t *blk, Decoded *o) {
    const float d = f16_to_f32(read_u16(blk));
    for (int s = 0; s < 8; s++) {
        const uint8_t *q = blk + 2 + 8 * s;
        const uint32_t aux = read_u32(q + 4);
        for (int g = 0; g < 4; g++) grid_row(GRID_IQ2_XXS, q[g], ksign((aux >> (7 * g)) & 127), o->v + 32 * s + 8 * g);
        o->fs[2 * s] = o->fs[2 * s + 1] = d * (0.5f + (float)(aux >> 28)) * 0.25f;
        o->fm[2 * s] = o->fm[2 * s + 1] = 0.0f;
    }
}

static void decode_iq2_xs(const uint8_t *blk, Decoded *o) {
    for (int t = 0; t < 32; t++) {
        const uint16_t q = read_u16(blk + 2 + 2 * t);
        grid_row(GRID_IQ2_XS, q & 511, ksign(q >> 9), o->v + 8 * t);
    }
    iq2_scales16(blk + 66, f16_to_f32(read_u16(blk)), o);
}

static void decode_iq2_s(const uint8_t *blk, Decoded *o) {
    const uint8_t *qs = blk + 2, *signs = blk + 34, *qh = blk + 66;
    for (int t = 0; t < 32; t++)
        grid_row(GRID_IQ2_S, qs[t] | (((qh[t / 4] >> (2 * (t % 4))) & 3) << 8), signs[t], o->v + 8 * t);
    iq2_scales16(blk + 74, f16_to_f32(read_u16(blk)), o);
}

/* Four values of an IQ3 grid row, each negated where bit i of `signs` is set. */
static inline void grid_row4(GridId g, uint32_t index, uint32_t signs, int8_t *out) {
    const int8_t *row = grids[g] + (size_t)index * 4;
    for (int i = 0; i < 4; i++) out[i] = (signs >> i) & 1 ? (int8_t)-row[i] : row[i];
}

static void decode_iq3_xxs(const uint8_t *blk, Decoded *o) {
    const float d = f16_to_f32(read_u16(blk));
    const uint8_t *qs = blk + 2;
    for (int s = 0; s < 8; s++) {
        const uint32_t aux = read_u32(blk + 66 + 4 * s);
        for (int g = 0; g < 4; g++) {
            const uint8_t signs = ksign((aux >> (7 * g)) & 127);
            grid_row4(GRID_IQ3_XXS, qs[8 * s + 2 * g], signs, o->v + 32 * s + 8 * g);
            grid_row4(GRID_IQ3_XXS, qs[8 * s + 2 * g + 1], signs >> 4, o->v + 32 * s + 8 * g + 4);
        }
        o->fs[2 * s] = o->fs[2 * s + 1] = d * (0.5f + (float)(aux >> 28)) * 0.5f;
        o->fm[2 * s] = o->fm[2 * s + 1] = 0.0f;
    }
}

static void decode_iq3_s(const uint8_t *blk, Decoded *o) {
    const float d = f16_to_f32(read_u16(blk));
    const uint8_t *qs = blk + 2, *qh = blk + 66, *signs = blk + 74, *scales = blk + 106;
    for (int u = 0; u < 64; u++)
        grid_row4(GRID_IQ3_S, qs[u] | (((qh[u / 8] >> (u % 8)) & 1) << 8), signs[u / 2] >> (4 * (u % 2)), o->v + 4 * u);
    for (int j = 0; j < 8; j++) {
        o->fs[2 * j] = o->fs[2 * j + 1] = d * (float)(1 + 2 * ((scales[j / 2] >> (4 * (j % 2))) & 15));
        o->fm[2 * j] = o->fm[2 * j + 1] = 0.0f;
    }
}

/* Eight IQ1 values of grid row `index` (-1, 0, 1) with the group's delta: 8 g + 1, or 8 g - 1. */
static inline void iq1_row(uint32_t index, int negative_delta, int8_t *out) {
    const int8_t *row = grids[GRID_IQ1_S] + (size_t)index * 8;
    for (int i = 0; i < 8; i++) out[i] = (int8_t)(8 * row[i] + (negative_delta ? -1 : 1));
}

static void decode_iq1_s(const uint8_t *blk, Decoded *o) {
    const float d = f16_to_f32(read_u16(blk));
    const uint8_t *qs = blk + 2;
    for (int s = 0; s < 8; s++) {
        const uint16_t qh = read_u16(blk + 34 + 2 * s);
        for (int g = 0; g < 4; g++) iq1_row(qs[4 * s + g] | (((qh >> (3 * g)) & 7) << 8), qh >> 15, o->v + 32 * s + 8 * g);
        o->fs[2 * s] = o->fs[2 * s + 1] = d * (float)(2 * ((qh >> 12) & 7) + 1) * 0.125f;
        o->fm[2 * s] = o->fm[2 * s + 1] = 0.0f;
    }
}

static void decode_iq1_m(const uint8_t *blk, Decoded *o) {
    const uint8_t *qs = blk, *qh = blk + 32;
    uint16_t sc[4];
    for (int i = 0; i < 4; i++) sc[i] = read_u16(blk + 48 + 2 * i);
    /* the fp16 d is the top nibbles of the four scale words */
    const float d = f16_to_f32((uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) | ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000)));
    for (int t = 0; t < 32; t++) {
        const int nib = (qh[t / 2] >> (4 * (t % 2))) & 15;
        iq1_row(qs[t] | ((nib & 7) << 8), nib >> 3, o->v + 8 * t);
    }
    for (int j = 0; j < 16; j++) {
        o->fs[j] = d * (float)(2 * ((sc[j / 4] >> (3 * (j % 4))) & 7) + 1) * 0.125f;
        o->fm[j] = 0.0f;
    }
}

/* Install grid `name` (rows x width int8 values, the row-major table of gguf.quants' grid): 0, or 1
 * for an unknown name or a wrong shape. Copied; a second call replaces the first. */
int64_t set_quant_grid(const char *name, const int8_t *values, int64_t rows, int64_t width) {
    for (int g = 0; g < NUM_GRIDS; g++) {
        if (strcmp(name, GRID_NAMES[g]) != 0) continue;
        if (rows != GRID_ROWS[g] || width != GRID_WIDTH[g]) return 1;
        int8_t *copy = malloc((size_t)(rows * width));
        if (copy == NULL) return 1;
        memcpy(copy, values, (size_t)(rows * width));
        int8_t *old = grids[g];
        grids[g] = copy;
        free(old);
        return 0;
    }
    return 1;
}

/* The grid a format's blocks index (-1: none). */
static int grid_of(const char *type_name) {
    if (strcmp(type_name, "iq1_m") == 0) return GRID_IQ1_S;
    for (int g = 0; g < NUM_GRIDS; g++)
        if (strcmp(type_name, GRID_NAMES[g]) == 0) return g;
    return -1;
}

/* 1 where a format can be multiplied now: it needs no grid, or its grid is installed. */
int64_t weight_type_ready(const char *type_name) {
    const int g = grid_of(type_name);
    return g < 0 || grids[g] != NULL;
}

/* The grid a format needs (its gguf.quants class name in lower case), or NULL. */
const char *weight_type_grid(const char *type_name) {
    const int g = grid_of(type_name);
    return g < 0 ? NULL : GRID_NAMES[g];
}

/* out[b] = row w (blocks of `block` weights, `bytes` each) . input row b0 + b, b < NB; the input
 * groups are the blocks. The plain C body, and the AVX2 one where the build has it. */
static inline __attribute__((always_inline)) void dot_decoded_ref(DecodeBlock decode, const int block, const int bytes,
                                                                 const uint8_t *w, const QuantRows *q, int64_t b0,
                                                                 const int NB, float *out) {
    const InputRows in = input_rows(q, b0, NB);
    const int subs = block / 16;
    float acc[QROWS] = {0};
    Decoded dec;
    for (int64_t i = 0; i < q->k / block; i++) {
        decode(w + i * bytes, &dec);
        for (int b = 0; b < NB; b++) {
            const int8_t *xh = in.hi[b] + i * block, *xl = in.lo[b] + i * block;
            const int32_t *s16 = in.sums[b] + i * subs;
            float sum = 0.0f;
            for (int j = 0; j < subs; j++) {
                int32_t h = 0, l = 0;
                for (int e = 0; e < 16; e++) {
                    h += dec.v[16 * j + e] * xh[16 * j + e];
                    l += dec.v[16 * j + e] * xl[16 * j + e];
                }
                sum += dec.fs[j] * (float)(127 * h + l) + dec.fm[j] * (float)s16[j];
            }
            acc[b] += in.d[b][i] * sum;
        }
    }
    for (int b = 0; b < NB; b++) out[b] = acc[b];
}

#if QUANT_SIMD
static inline __attribute__((always_inline)) void dot_decoded(DecodeBlock decode, const int block, const int bytes,
                                                             const uint8_t *w, const QuantRows *q, int64_t b0,
                                                             const int NB, float *out) {
    const InputRows in = input_rows(q, b0, NB);
    const int subs = block / 16;
    __m256 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();
    float mins[QROWS] = {0};
    Decoded dec;
    for (int64_t i = 0; i < q->k / block; i++) {
        decode(w + i * bytes, &dec);
        for (int b = 0; b < NB; b++) {
            const int8_t *xh = in.hi[b] + i * block, *xl = in.lo[b] + i * block;
            const int two = in.two[b][i];
            const __m256 dx = _mm256_set1_ps(in.d[b][i]);
            for (int c = 0; c < block / 32; c++) {
                const __m256i v = load_i8(dec.v + 32 * c), av = _mm256_sign_epi8(v, v);
                /* lanes 0-3: sub-block 2c, lanes 4-7: 2c + 1 (vpmaddubsw and vpmaddwd stay in their 128-bit half) */
                __m256i s = dot_us(av, _mm256_sign_epi8(load_i8(xh + 32 * c), v));
                s = _mm256_sub_epi32(_mm256_slli_epi32(s, 7), s);
                if (two) s = _mm256_add_epi32(s, dot_us(av, _mm256_sign_epi8(load_i8(xl + 32 * c), v)));
                const __m256 fs = _mm256_setr_m128(_mm_set1_ps(dec.fs[2 * c]), _mm_set1_ps(dec.fs[2 * c + 1]));
                acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(fs, dx), _mm256_cvtepi32_ps(s), acc[b]);
            }
        }
        if (decode == decode_q2_k || decode == decode_q5_k)
            for (int b = 0; b < NB; b++) {
                const int32_t *s16 = in.sums[b] + i * subs;
                float m = 0.0f;
                for (int j = 0; j < subs; j++) m += dec.fm[j] * (float)s16[j];
                mins[b] += in.d[b][i] * m;
            }
    }
    for (int b = 0; b < NB; b++) out[b] = sum8(acc[b]) + mins[b];
}
#else
#define dot_decoded dot_decoded_ref
#endif

/* The table's rows: (name, weights per block, bytes per block). */
#define DECODED_FORMATS(X)                                                                                       \
    X(q2_k, 256, 84) X(q3_k, 256, 110) X(q5_k, 256, 176) X(iq4_nl, 32, 18) X(iq4_xs, 256, 136)                  \
    X(iq2_xxs, 256, 66) X(iq2_xs, 256, 74) X(iq2_s, 256, 82) X(iq3_xxs, 256, 98) X(iq3_s, 256, 110)            \
    X(iq1_s, 256, 50) X(iq1_m, 256, 56)

#define DEFINE_DECODED(NAME, BLOCK, BYTES)                                                                       \
    DEFINE_QUANT_LINEAR_ROWS(linear_rows_##NAME, BLOCK, dot_decoded(decode_##NAME, BLOCK, BYTES, w, q, b0, NB, out)) \
    void to_f32_##NAME(const Linear *m, int64_t r, float *out) {                                                 \
        const uint8_t *row = (const uint8_t *)m->data + r * m->row_bytes;                                        \
        Decoded dec;                                                                                             \
        for (int64_t i = 0; i < m->k / BLOCK; i++) {                                                             \
            decode_##NAME(row + i * BYTES, &dec);                                                                \
            for (int e = 0; e < BLOCK; e++) out[i * BLOCK + e] = dec.fs[e / 16] * (float)dec.v[e] + dec.fm[e / 16]; \
        }                                                                                                        \
    }
DECODED_FORMATS(DEFINE_DECODED)
#undef DEFINE_DECODED
