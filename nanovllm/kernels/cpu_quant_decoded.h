/* The formats multiplied through a decoded block (included by cpu_quant.c after the per-instruction-
 * set bodies): Q2_K, Q3_K, Q5_K, IQ4_NL, IQ4_XS and the grid i-quants IQ2_XXS, IQ2_XS, IQ2_S,
 * IQ3_XXS, IQ3_S, IQ1_S, IQ1_M (the block layouts are ggml's, ggml-common.h; gguf.quants'
 * dequantizers are the tests' reference).
 *
 * Every one of them is, per sub-block of 16 weights, a signed 8-bit integer per weight times a
 * small integer scale, under one float scale per block, plus (Q2_K, Q5_K) an integer min under one
 * float min scale:
 *     w[16 j + e] = (D is[j]) v[16 j + e] + Dm im[j]
 * (the i-quants' (0.5 + s) / 4 and the like are (2 s + 1) under D = d / 8: the same products, as
 * powers of two commute with rounding; IQ1's delta of +-1/8 of the scale on a group of 8 is in the
 * integers: dl (g + delta) = dl / 8 (8 g +- 1)). Each weight row is decoded into that form once per
 * call (per block of input rows) and multiplied into every input row, whose groups are the blocks
 * (256, or IQ4_NL's 32): the integer dot of each 16 v with the two input planes (AVX2: |v| x
 * sign(x, v) by vpmaddubsw, each 32 bytes two sub-blocks), times is[j] by vpmaddwd, summed in int32
 * over the block, then scaled by D (x 127 for the high plane) in fp32; the mins from the input's
 * integer sums of 16. The i-quants' grids are installed from the gguf package at load
 * (set_quant_grid, from cpu_kernels.py); a table row of an i-quant without its grid is not valid. */

typedef struct {
    int8_t *v;       /* [block] values */
    int16_t *is;     /* [block / 16] integer scales: a sub-block's scale is D is[j] */
    float *D;        /* [1] the block's scale */
    int16_t *im;     /* [block / 16] integer mins (Q2_K, Q5_K; the others leave it unwritten): Dm im[j] */
    float *Dm;       /* [1] (likewise) */
} Decoded;

typedef void (*DecodeBlock)(const uint8_t *blk, const Decoded *o);

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

/* SIGN_MASKS[s]: byte i 0xFF where bit i of s is set, else 0 ((x ^ m) - m negates those bytes). */
static uint64_t SIGN_MASKS[256];
static void fill_sign_masks(void) {
    for (int s = 0; s < 256; s++) {
        uint64_t m = 0;
        for (int i = 0; i < 8; i++) m |= (uint64_t)((s >> i) & 1 ? 0xFF : 0) << (8 * i);
        SIGN_MASKS[s] = m;
    }
}

/* ---- the decoders' vector pieces, by instruction set -------------------------------------------- */
#if QUANT_SIMD
/* Q2_K's 256 2-bit values (value 128 h + 32 s + l: bits 2 s of qs[32 h + l]). */
static inline void q2k_values(const uint8_t *qs, int8_t *v) {
    for (int h = 0; h < 2; h++) {
        const __m256i q = load_i8(qs + 32 * h), three = _mm256_set1_epi8(3);
        for (int s = 0; s < 4; s++)
            _mm256_storeu_si256((__m256i *)(v + 128 * h + 32 * s), _mm256_and_si256(_mm256_srli_epi16(q, 2 * s), three));
    }
}

/* 16 bytes as their low nibbles (lo) and high nibbles (hi), widened to int16. */
static inline void nibble_pairs16(const uint8_t *p, int16_t *lo, int16_t *hi) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), nib = _mm_set1_epi8(15);
    _mm256_storeu_si256((__m256i *)lo, _mm256_cvtepu8_epi16(_mm_and_si128(b, nib)));
    _mm256_storeu_si256((__m256i *)hi, _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), nib)));
}

/* Q3_K's 256 values, -4..3: Q2_K's layout of the low 2 bits, 4 lower where bit idx / 32 of hmask[l] is clear. */
static inline void q3k_values(const uint8_t *hmask, const uint8_t *qs, int8_t *v) {
    const __m256i hm = load_i8(hmask), three = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const __m256i q = load_i8(qs + 32 * h);
        for (int s = 0; s < 4; s++) {
            const int b = 4 * h + s;
            const __m256i bit = _mm256_set1_epi8((char)(1 << b));
            const __m256i clear = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), _mm256_setzero_si256());
            const __m256i low = _mm256_and_si256(_mm256_srli_epi16(q, 2 * s), three);
            _mm256_storeu_si256((__m256i *)(v + 32 * b), _mm256_sub_epi8(low, _mm256_and_si256(clear, _mm256_set1_epi8(4))));
        }
    }
}

/* Q5_K's 256 values, 0..31: nibbles of qs (64 c + 32 a + l: nibble a of qs[32 c + l]), the fifth bit
 * bit idx / 32 of qh[l]. */
static inline void q5k_values(const uint8_t *qh, const uint8_t *qs, int8_t *v) {
    const __m256i h = load_i8(qh), nib = _mm256_set1_epi8(15);
    for (int c = 0; c < 4; c++) {
        const __m256i q = load_i8(qs + 32 * c);
        for (int a = 0; a < 2; a++) {
            const int b = 2 * c + a;
            const __m256i bit = _mm256_set1_epi8((char)(1 << b));
            const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit), _mm256_set1_epi8(16));
            _mm256_storeu_si256((__m256i *)(v + 32 * b), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4 * a), nib), high));
        }
    }
}

/* The 32 levels of 16 bytes of IQ4 nibbles (the low nibbles' first) at out. */
static inline void iq4_values(const uint8_t *p, int8_t *out) {
    const __m128i q = _mm_loadu_si128((const __m128i *)p), table = _mm_loadu_si128((const __m128i *)IQ4_LEVELS);
    const __m128i nib = _mm_set1_epi8(15);
    _mm_storeu_si128((__m128i *)out, _mm_shuffle_epi8(table, _mm_and_si128(q, nib)));
    _mm_storeu_si128((__m128i *)(out + 16), _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), nib)));
}

/* Eight grid values at row, negated where bit i of `signs` is set, at out ((x ^ m) - m, m a byte mask). */
static inline void signed_row(const int8_t *row, uint8_t signs, int8_t *out) {
    const __m128i m = _mm_loadl_epi64((const __m128i *)&SIGN_MASKS[signs]);
    const __m128i r = _mm_loadl_epi64((const __m128i *)row);
    _mm_storel_epi64((__m128i *)out, _mm_sub_epi8(_mm_xor_si128(r, m), m));
}
#else
static inline void q2k_values(const uint8_t *qs, int8_t *v) {
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) v[128 * h + 32 * s + l] = (int8_t)((qs[32 * h + l] >> (2 * s)) & 3);
}

static inline void nibble_pairs16(const uint8_t *p, int16_t *lo, int16_t *hi) {
    for (int j = 0; j < 16; j++) {
        lo[j] = p[j] & 15;
        hi[j] = p[j] >> 4;
    }
}

static inline void q3k_values(const uint8_t *hmask, const uint8_t *qs, int8_t *v) {
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) {
                const int idx = 128 * h + 32 * s + l;
                v[idx] = (int8_t)(((qs[32 * h + l] >> (2 * s)) & 3) - ((hmask[l] >> (idx / 32)) & 1 ? 0 : 4));
            }
}

static inline void q5k_values(const uint8_t *qh, const uint8_t *qs, int8_t *v) {
    for (int c = 0; c < 4; c++)
        for (int a = 0; a < 2; a++)
            for (int l = 0; l < 32; l++) {
                const int idx = 64 * c + 32 * a + l;
                v[idx] = (int8_t)(((qs[32 * c + l] >> (4 * a)) & 15) | (((qh[l] >> (idx / 32)) & 1) << 4));
            }
}

static inline void iq4_values(const uint8_t *p, int8_t *out) {
    for (int l = 0; l < 16; l++) {
        out[l] = IQ4_LEVELS[p[l] & 15];
        out[16 + l] = IQ4_LEVELS[p[l] >> 4];
    }
}

static inline void signed_row(const int8_t *row, uint8_t signs, int8_t *out) {
    for (int i = 0; i < 8; i++) out[i] = (signs >> i) & 1 ? (int8_t)-row[i] : row[i];
}
#endif

/* Eight values of a grid row, each negated where bit i of `signs` is set, at out. */
static inline void grid_row(GridId g, uint32_t index, uint8_t signs, int8_t *out) {
    signed_row(grids[g] + (size_t)index * 8, signs, out);
}

/* Two four-value IQ3 grid rows side by side, the 8 values negated where bit i of `signs` is set. */
static inline void grid_rows4(GridId g, uint32_t first, uint32_t second, uint8_t signs, int8_t *out) {
    int8_t pair[8];
    memcpy(pair, grids[g] + (size_t)first * 4, 4);
    memcpy(pair + 4, grids[g] + (size_t)second * 4, 4);
    signed_row(pair, signs, out);
}


static inline __attribute__((always_inline)) void decode_q2_k(const uint8_t *blk, const Decoded *o) {
    const uint8_t *sc = blk, *qs = blk + 16;
    const float d = f16_to_f32(read_u16(blk + 80)), dmin = f16_to_f32(read_u16(blk + 82));
    q2k_values(qs, o->v);
    nibble_pairs16(sc, o->is, o->im);
    o->D[0] = d, o->Dm[0] = -dmin;
}

static inline __attribute__((always_inline)) void decode_q3_k(const uint8_t *blk, const Decoded *o) {
    const uint8_t *hmask = blk, *qs = blk + 32, *sc = blk + 96;
    const float d = f16_to_f32(read_u16(blk + 108));
    q3k_values(hmask, qs, o->v);
    /* scale j: the low 4 bits are nibble j / 8 of byte j % 8, the high 2 bits are bits 2 (j / 4) of
     * byte 8 + j % 4: four bytes at a time in 32-bit words */
    const uint32_t a0 = read_u32(sc), a1 = read_u32(sc + 4), a2 = read_u32(sc + 8), m4 = 0x0F0F0F0Fu, m2 = 0x03030303u;
    const uint32_t words[4] = {(a0 & m4) | ((a2 & m2) << 4), (a1 & m4) | (((a2 >> 2) & m2) << 4),
                               ((a0 >> 4) & m4) | (((a2 >> 4) & m2) << 4), ((a1 >> 4) & m4) | (((a2 >> 6) & m2) << 4)};
    const uint8_t *six = (const uint8_t *)words;
    for (int j = 0; j < 16; j++) o->is[j] = (int16_t)(six[j] - 32);
    o->D[0] = d;
}

static inline __attribute__((always_inline)) void decode_q5_k(const uint8_t *blk, const Decoded *o) {
    const float d = f16_to_f32(read_u16(blk)), dmin = f16_to_f32(read_u16(blk + 2));
    const uint8_t *qh = blk + 16, *qs = blk + 48;
    uint8_t sc[8], mn[8];
    q4k_scales(blk + 4, sc, mn);
    q5k_values(qh, qs, o->v);
    for (int j = 0; j < 16; j++) {
        o->is[j] = sc[j / 2];
        o->im[j] = mn[j / 2];
    }
    o->D[0] = d, o->Dm[0] = -dmin;
}


static inline __attribute__((always_inline)) void decode_iq4_nl(const uint8_t *blk, const Decoded *o) {
    const float d = f16_to_f32(read_u16(blk));
    iq4_values(blk + 2, o->v);
    o->is[0] = o->is[1] = 1;
    o->D[0] = d;
}

static inline __attribute__((always_inline)) void decode_iq4_xs(const uint8_t *blk, const Decoded *o) {
    const float d = f16_to_f32(read_u16(blk));
    const uint16_t sh = read_u16(blk + 2);
    const uint8_t *sl = blk + 4, *qs = blk + 8;
    for (int j = 0; j < 8; j++) {
        const int ls = (((sl[j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)) - 32;
        o->is[2 * j] = o->is[2 * j + 1] = (int16_t)ls;
        iq4_values(qs + 16 * j, o->v + 32 * j);
    }
    o->D[0] = d;
}

/* The 4-bit scales of IQ2_XS / IQ2_S, one per 16 weights: d (0.5 + s) / 4 = d / 8 (2 s + 1). */
static inline void iq2_scales16(const uint8_t *scales, float d, const Decoded *o) {
    for (int j = 0; j < 16; j++) {
        o->is[j] = (int16_t)(2 * ((scales[j / 2] >> (4 * (j % 2))) & 15) + 1);
    }
    o->D[0] = d * 0.125f;
}

static inline __attribute__((always_inline)) void decode_iq2_xxs(const uint8_t *blk, const Decoded *o) {
    const float d = f16_to_f32(read_u16(blk));
    for (int s = 0; s < 8; s++) {
        const uint8_t *q = blk + 2 + 8 * s;
        const uint32_t aux = read_u32(q + 4);
        for (int g = 0; g < 4; g++) grid_row(GRID_IQ2_XXS, q[g], ksign((aux >> (7 * g)) & 127), o->v + 32 * s + 8 * g);
        o->is[2 * s] = o->is[2 * s + 1] = (int16_t)(2 * (aux >> 28) + 1);
    }
    o->D[0] = d * 0.125f;
}

static inline __attribute__((always_inline)) void decode_iq2_xs(const uint8_t *blk, const Decoded *o) {
    for (int t = 0; t < 32; t++) {
        const uint16_t q = read_u16(blk + 2 + 2 * t);
        grid_row(GRID_IQ2_XS, q & 511, ksign(q >> 9), o->v + 8 * t);
    }
    iq2_scales16(blk + 66, f16_to_f32(read_u16(blk)), o);
}

static inline __attribute__((always_inline)) void decode_iq2_s(const uint8_t *blk, const Decoded *o) {
    const uint8_t *qs = blk + 2, *signs = blk + 34, *qh = blk + 66;
    for (int t = 0; t < 32; t++)
        grid_row(GRID_IQ2_S, qs[t] | (((qh[t / 4] >> (2 * (t % 4))) & 3) << 8), signs[t], o->v + 8 * t);
    iq2_scales16(blk + 74, f16_to_f32(read_u16(blk)), o);
}


static inline __attribute__((always_inline)) void decode_iq3_xxs(const uint8_t *blk, const Decoded *o) {
    const float d = f16_to_f32(read_u16(blk));
    const uint8_t *qs = blk + 2;
    for (int s = 0; s < 8; s++) {
        const uint32_t aux = read_u32(blk + 66 + 4 * s);
        for (int g = 0; g < 4; g++)
            grid_rows4(GRID_IQ3_XXS, qs[8 * s + 2 * g], qs[8 * s + 2 * g + 1], ksign((aux >> (7 * g)) & 127),
                       o->v + 32 * s + 8 * g);
        o->is[2 * s] = o->is[2 * s + 1] = (int16_t)(2 * (aux >> 28) + 1);
    }
    o->D[0] = d * 0.25f;
}

static inline __attribute__((always_inline)) void decode_iq3_s(const uint8_t *blk, const Decoded *o) {
    const float d = f16_to_f32(read_u16(blk));
    const uint8_t *qs = blk + 2, *qh = blk + 66, *signs = blk + 74, *scales = blk + 106;
    for (int t = 0; t < 32; t++)
        grid_rows4(GRID_IQ3_S, qs[2 * t] | (((qh[t / 4] >> (2 * t % 8)) & 1) << 8),
                   qs[2 * t + 1] | (((qh[t / 4] >> (2 * t % 8 + 1)) & 1) << 8), signs[t], o->v + 8 * t);
    for (int j = 0; j < 8; j++) {
        o->is[2 * j] = o->is[2 * j + 1] = (int16_t)(1 + 2 * ((scales[j / 2] >> (4 * (j % 2))) & 15));
    }
    o->D[0] = d;
}

/* Eight IQ1 values of grid row `index` (-1, 0, 1) with the group's delta: 8 g + 1, or 8 g - 1. */
static inline void iq1_row(uint32_t index, int negative_delta, int8_t *out) {
    const int8_t *row = grids[GRID_IQ1_S] + (size_t)index * 8;
    for (int i = 0; i < 8; i++) out[i] = (int8_t)(8 * row[i] + (negative_delta ? -1 : 1));
}

static inline __attribute__((always_inline)) void decode_iq1_s(const uint8_t *blk, const Decoded *o) {
    const float d = f16_to_f32(read_u16(blk));
    const uint8_t *qs = blk + 2;
    for (int s = 0; s < 8; s++) {
        const uint16_t qh = read_u16(blk + 34 + 2 * s);
        for (int g = 0; g < 4; g++) iq1_row(qs[4 * s + g] | (((qh >> (3 * g)) & 7) << 8), qh >> 15, o->v + 32 * s + 8 * g);
        o->is[2 * s] = o->is[2 * s + 1] = (int16_t)(2 * ((qh >> 12) & 7) + 1);
    }
    o->D[0] = d * 0.125f;
}

static inline __attribute__((always_inline)) void decode_iq1_m(const uint8_t *blk, const Decoded *o) {
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
        o->is[j] = (int16_t)(2 * ((sc[j / 4] >> (3 * (j % 4))) & 7) + 1);
    }
    o->D[0] = d * 0.125f;
}

/* Install grid `name` (rows x width int8 values, the row-major table of gguf.quants' grid): 0, or 1
 * for an unknown name or a wrong shape. Copied; a second call replaces the first. */
int64_t set_quant_grid(const char *name, const int8_t *values, int64_t rows, int64_t width) {
    for (int g = 0; g < NUM_GRIDS; g++) {
        if (strcmp(name, GRID_NAMES[g]) != 0) continue;
        if (rows != GRID_ROWS[g] || width != GRID_WIDTH[g]) return 1;
        if (SIGN_MASKS[1] == 0) fill_sign_masks();
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

/* One thread's decoded weight row (DecodedRow's arrays), grown as needed and kept for its next calls;
 * NULL where it cannot be had (the caller skips its share and reports it). */
static _Thread_local void *decoded_row;
static _Thread_local int64_t decoded_capacity;
static void *decoded_buffer(int64_t k) {
    const int64_t bytes = k + 2 * (k / 16) * (int64_t)sizeof(int16_t) + 2 * (k / 32) * (int64_t)sizeof(float) + 64;
    if (bytes > decoded_capacity) {
        free(decoded_row);
        decoded_row = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
        decoded_capacity = decoded_row != NULL ? bytes : 0;
    }
    return decoded_row;
}

/* The weight row w of k weights (blocks of `block`, `bytes` each) decoded into buf: values [k],
 * integer scales and mins [k / 16], block scales and min scales [k / block]. */
static inline __attribute__((always_inline)) Decoded decode_row(DecodeBlock decode, const int block, const int bytes,
                                                                const uint8_t *w, int64_t k, void *buf) {
    int8_t *v = buf;
    int16_t *is = (int16_t *)(v + k), *im = is + k / 16;
    float *D = (float *)(im + k / 16), *Dm = D + k / block;
    for (int64_t i = 0; i < k / block; i++) {
        const Decoded at = {v + i * block, is + i * (block / 16), D + i, im + i * (block / 16), Dm + i};
        decode(w + i * bytes, &at);
    }
    return (Decoded){v, is, D, im, Dm};
}

/* The mins' part of block i for input row b: Dm sum_j im[j] S[j], S the input's integer sums of 16. */
static inline float block_mins(const Decoded *row, int64_t i, const int subs, const int32_t *s16) {
    int32_t m = 0;
    for (int j = 0; j < subs; j++) m += row->im[i * subs + j] * s16[j];
    return row->Dm[i] * (float)m;
}

/* out[b] = the decoded row . input row b0 + b, b < NB; the input groups are the blocks (`block`
 * weights); mins: the row has mins. The plain C body, and the AVX2 one where the build has it. */
static inline __attribute__((always_inline)) void dot_decoded_ref(const Decoded *row, const int block, const int mins,
                                                                 const QuantRows *q, int64_t b0, const int NB,
                                                                 float *out) {
    const InputRows in = input_rows(q, b0, NB);
    const int subs = block / 16;
    float acc[QROWS] = {0};
    for (int64_t i = 0; i < q->k / block; i++) {
        const int8_t *v = row->v + i * block;
        for (int b = 0; b < NB; b++) {
            const int8_t *xh = in.hi[b] + i * block, *xl = in.lo[b] + i * block;
            int32_t h = 0, l = 0;
            for (int j = 0; j < subs; j++) {
                int32_t hj = 0, lj = 0;
                for (int e = 0; e < 16; e++) {
                    hj += v[16 * j + e] * xh[16 * j + e];
                    lj += v[16 * j + e] * xl[16 * j + e];
                }
                h += row->is[i * subs + j] * hj;
                l += row->is[i * subs + j] * lj;
            }
            const float dx = in.d[b][i];
            acc[b] += dx * (row->D[i] * (127.0f * (float)h + (float)l));
            if (mins) acc[b] += dx * block_mins(row, i, subs, in.sums[b] + i * subs);
        }
    }
    for (int b = 0; b < NB; b++) out[b] = acc[b];
}

#if QUANT_SIMD
static inline __attribute__((always_inline)) void dot_decoded(const Decoded *row, const int block, const int mins,
                                                             const QuantRows *q, int64_t b0, const int NB, float *out) {
    const InputRows in = input_rows(q, b0, NB);
    const int subs = block / 16;
    __m256 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();
    __m256 min_sum[QROWS];
    for (int b = 0; b < NB; b++) min_sum[b] = _mm256_setzero_ps();
    for (int64_t i = 0; i < q->k / block; i++) {
        const int8_t *v0 = row->v + i * block;
        const int16_t *is = row->is + i * subs;
        __m256i hi[QROWS], lo[QROWS];
        for (int b = 0; b < NB; b++) hi[b] = lo[b] = _mm256_setzero_si256();
        for (int c = 0; c < block / 32; c++) {
            const __m256i v = load_i8(v0 + 32 * c), av = _mm256_sign_epi8(v, v);
            /* int16 lanes 0-7: sub-block 2c's scale, 8-15: 2c + 1's (vpmaddubsw and vpmaddwd stay in their 128-bit
             * half): the pair broadcast as one 32-bit word, each half taking its own 16 bits */
            int32_t pair;
            memcpy(&pair, is + 2 * c, sizeof pair);
            const __m256i scale = _mm256_shuffle_epi8(_mm256_set1_epi32(pair), _mm256_setr_epi8(
                0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3));
            for (int b = 0; b < NB; b++) {
                const int64_t at = i * block + 32 * c;
                hi[b] = _mm256_add_epi32(hi[b], _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(load_i8(in.hi[b] + at), v)), scale));
                if (in.two[b][i])
                    lo[b] = _mm256_add_epi32(lo[b], _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(load_i8(in.lo[b] + at), v)), scale));
            }
        }
        for (int b = 0; b < NB; b++) {
            acc[b] = add_planes(acc[b], in.d[b][i] * row->D[i], hi[b], lo[b]);
            if (mins) { /* (block == 256: Q2_K, Q5_K) 16 integer mins x the input's 16 sums */
                const __m256i im = load_i8(row->im + i * 16);
                const int32_t *s16 = in.sums[b] + i * 16;
                const __m256i m = _mm256_add_epi32(
                    _mm256_mullo_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(im)), load_i8(s16)),
                    _mm256_mullo_epi32(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(im, 1)), load_i8(s16 + 8)));
                min_sum[b] = _mm256_fmadd_ps(_mm256_set1_ps(in.d[b][i] * row->Dm[i]), _mm256_cvtepi32_ps(m), min_sum[b]);
            }
        }
    }
    for (int b = 0; b < NB; b++) out[b] = sum8(acc[b]) + (mins ? sum8(min_sum[b]) : 0.0f);
}
#else
#define dot_decoded dot_decoded_ref
#endif

/* The table's rows: (name, weights per block, bytes per block, has mins). */
#define DECODED_FORMATS(X)                                                                                       \
    X(q2_k, 256, 84, 1) X(q3_k, 256, 110, 0) X(q5_k, 256, 176, 1) X(iq4_nl, 32, 18, 0) X(iq4_xs, 256, 136, 0)  \
    X(iq2_xxs, 256, 66, 0) X(iq2_xs, 256, 74, 0) X(iq2_s, 256, 82, 0) X(iq3_xxs, 256, 98, 0)                   \
    X(iq3_s, 256, 110, 0) X(iq1_s, 256, 50, 0) X(iq1_m, 256, 56, 0)

/* A format's LinearRows (DEFINE_QUANT_LINEAR_ROWS_WITH): each thread decodes each of its weight rows
 * once per block of input rows into its buffer, and multiplies it into them QROWS at a time. */
#define DEFINE_DECODED(NAME, BLOCK, BYTES, MINS)                                                                 \
    DEFINE_QUANT_LINEAR_ROWS_WITH(linear_rows_##NAME, BLOCK,                                                     \
                                  void *buf = decoded_buffer(m->k); if (buf == NULL) no_rows = 1,                \
                                  const Decoded row = decode_row(decode_##NAME, BLOCK, BYTES, w, m->k, buf); ctx = &row, \
                                  dot_decoded((const Decoded *)ctx, BLOCK, MINS, q, b0, NB, out))                 \
    void to_f32_##NAME(const Linear *m, int64_t r, float *out) {                                                 \
        int8_t v[BLOCK] __attribute__((aligned(32)));                                                            \
        int16_t is[BLOCK / 16], im[BLOCK / 16];                                                                  \
        float D, Dm;                                                                                             \
        const Decoded dec = {v, is, &D, im, &Dm};                                                                \
        const uint8_t *row = (const uint8_t *)m->data + r * m->row_bytes;                                        \
        for (int64_t i = 0; i < m->k / BLOCK; i++) {                                                             \
            decode_##NAME(row + i * BYTES, &dec);                                                                \
            for (int e = 0; e < BLOCK; e++)                                                                      \
                out[i * BLOCK + e] = D * (float)is[e / 16] * (float)v[e] + (MINS ? Dm * (float)im[e / 16] : 0.0f); \
        }                                                                                                        \
    }
DECODED_FORMATS(DEFINE_DECODED)
#undef DEFINE_DECODED
