/* The AVX2 + FMA + F16C bodies of cpu_quant.c (included where QUANT_SIMD; the plain C reference of
 * each is in cpu_quant_ref.h, the same integers). */

static inline float hmax_ps(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* 8 int8 at p as 8 int32 lanes, and back (each lane within int8). */
static inline __m256i widen8(const int8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline void store_i8x8(int8_t *p, __m256i v) {
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(w, w));
}

/* 127 h + l, lane by lane: a dot product with X from those with its two planes. */
static inline __m256i planes(__m256i h, __m256i l) { return _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(h, 7), h), l); }
/* The sum of v's lanes, as (0 + 4) + (2 + 6) + ((1 + 5) + (3 + 7)): the plain build adds in this order too. */
static inline float sum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* s4 */
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));                                 /* s4[0] + s4[2], s4[1] + s4[3] */
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* One input row quantized (quantize_rows): hr, lr, d, two, sums are the row's own; xr16 the row's
 * int16 copy of X, or NULL. */
static void quantize_row_avx2(const float *xr, int64_t k, int64_t group, int mode, int8_t *hr, int8_t *lr,
                               int16_t *xr16, float *d, uint8_t *two, int32_t *sums) {
    const int64_t groups = k / group, sixteens = k / 16;
    /* The same integers as cpu_quant_ref.h's loop, 8 values at a time (prefill quantizes ~10^4 values
     * per row and layer, which the plain loop made a sixth of the matmuls' time): x inv rounded to
     * nearest even (the default rounding mode, as nearbyintf), and h = X / 127 rounded to nearest in
     * float (X is an integer and 127 odd, so X / 127 is never within 0.5 / 127 of a tie: exact). */
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i xmax = _mm256_set1_epi32(XMAX), xmin = _mm256_set1_epi32(-XMAX);
    const __m256 inv127 = _mm256_set1_ps(1.0f / 127.0f);
    for (int64_t g = 0; g < groups; g++) {
        const float *xg = xr + g * group;
        __m256 m = _mm256_setzero_ps(), ss = _mm256_setzero_ps();
        for (int64_t i = 0; i < group; i += 8) {
            const __m256 v = _mm256_loadu_ps(xg + i);
            m = _mm256_max_ps(m, _mm256_and_ps(v, absmask));
            if (mode == PLANES_AUTO) ss = _mm256_fmadd_ps(v, v, ss);
        }
        const float amax = hmax_ps(m);
        const float inv = amax > 0.0f ? (float)XMAX / amax : 0.0f;
        d[g] = amax / (float)XMAX;
        const __m256 vinv = _mm256_set1_ps(inv);
        two[g] = two_planes(mode, amax, sum8(ss), group);
        if (!two[g]) {
            const __m256 vinv1 = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
            for (int64_t i = 0; i < group; i += 8) {
                __m256i h = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + i), vinv1));
                h = _mm256_min_epi32(_mm256_max_epi32(h, bottom), top);
                if (xr16 != NULL) {
                    const __m256i X = _mm256_sub_epi32(_mm256_slli_epi32(h, 7), h);
                    _mm_storeu_si128((__m128i *)(xr16 + g * group + i),
                                     _mm_packs_epi32(_mm256_castsi256_si128(X), _mm256_extracti128_si256(X, 1)));
                }
                store_i8x8(hr + g * group + i, h);
                _mm_storel_epi64((__m128i *)(lr + g * group + i), _mm_setzero_si128());
            }
            continue;
        }
        for (int64_t i = 0; i < group; i += 8) {
            __m256i X = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + i), vinv));
            X = _mm256_min_epi32(_mm256_max_epi32(X, xmin), xmax);
            if (xr16 != NULL)
                _mm_storeu_si128((__m128i *)(xr16 + g * group + i),
                                 _mm_packs_epi32(_mm256_castsi256_si128(X), _mm256_extracti128_si256(X, 1)));
            const __m256i h = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_cvtepi32_ps(X), inv127));
            store_i8x8(hr + g * group + i, h);
            store_i8x8(lr + g * group + i, _mm256_sub_epi32(X, _mm256_sub_epi32(_mm256_slli_epi32(h, 7), h)));
        }
    }
    for (int64_t s = 0; s < sixteens; s++) {
        const int8_t *h = hr + 16 * s, *l = lr + 16 * s;
        const __m256i a = planes(widen8(h), widen8(l)), b = planes(widen8(h + 8), widen8(l + 8));
        sums[s] = hsum_epi32(_mm256_add_epi32(a, b));
    }
}

/* ---- the kernels -------------------------------------------------------------------------- */

/* IEEE half -> float (subnormals, infinities and NaNs included). */
static inline float f16_to_f32(uint16_t h) {
    return _cvtsh_ss(h);
}

/* ---- vector helpers --------------------------------------------------------------------------- */
/* 8 int32 sums of u (unsigned bytes) x s (signed bytes), 4 products each, and acc + that sum:
 * vpmaddubsw + vpmaddwd here, vpdpbusd where the CPU has VNNI (cpu_quant_vnni.h). */
static inline __m256i dot_us(__m256i u, __m256i s);
static inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s);
/* One block's unit products (below), by instruction set likewise. */
static inline __attribute__((always_inline)) void block_units_x8(Fmt32 f, const uint8_t *values, const int8_t *x[QROWS],
                                                                const int NB, __m256i sum[QROWS]);

/* 8 int32 sums of u (unsigned bytes) x s (signed bytes), 4 products each. NOTE: vpmaddubsw
 * saturates a pair's sum at int16: every caller keeps |u| * |s| * 2 <= 128 * 127 * 2. */
#if !QUANT_VNNI
static inline __m256i dot_us(__m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }
static inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif


static inline __m256i load_i8(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 16 bytes of packed nibbles as 32 bytes: the low nibbles first, then the high ones (the order
 * of values in Q4_0 / Q4_1 / Q5_* blocks). */
static inline __m256i nibbles_32(const uint8_t *p) {
    const __m128i t = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}

/* MXFP4's units (MXFP4_UNITS) of 32 nibble codes, in both 128-bit lanes for vpshufb. */
static inline __m256i mxfp4_units(__m256i codes) {
    const __m128i table = _mm_loadu_si128((const __m128i *)MXFP4_UNITS);
    return _mm256_shuffle_epi8(_mm256_set_m128i(table, table), codes);
}

/* The scales d of the 8 rows of an interleaved block (fp16 d[8], or MXFP4's e[8]). */
static inline __m256 scales_x8(Fmt32 f, const uint8_t *blk) {
    if (f != FMT_MXFP4) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
    /* e8m0_half lane by lane: (e - 1) << 23, or 0x00200000 << e for e < 2 (subnormal scales, which
     * trained weights do not have: one compare and a branch that is never taken) */
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)blk)), two = _mm256_set1_epi32(2);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny_lanes = _mm256_cmpgt_epi32(two, e);
    if (__builtin_expect(!_mm256_testz_si256(tiny_lanes, tiny_lanes), 0)) {
        const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
        return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, tiny_lanes));
    }
    return _mm256_castsi256_ps(normal);
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

/* out[b] = row w . input row b0 + b, for b < NB. */
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
        const float d = fmt_scale(f, blk);
        const float m = fmt_has_min(f) ? f16_to_f32(read_u16(blk + 2)) : 0.0f;
        __m256i wv = _mm256_setzero_si256(), aw;
        if (f == FMT_Q8_0) {
            wv = load_i8(blk + 2);
            aw = _mm256_sign_epi8(wv, wv); /* |w| as unsigned; the sign moves onto x */
        } else if (f == FMT_MXFP4) {
            aw = mxfp4_units(nibbles_32(blk + 1));
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
            if (fmt_offset(f) % 8) /* sum (q - off) x = sum q x - off S: all of it off lane 0 */
                p = _mm256_sub_epi32(p, _mm256_setr_epi32(fmt_offset(f) * s32, 0, 0, 0, 0, 0, 0, 0));
            else if (fmt_offset(f)) /* or off / 8 * S off each of the 8 lanes */
                p = _mm256_sub_epi32(p, _mm256_set1_epi32(fmt_offset(f) / 8 * s32));
            acc[i & 1][b] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(p), acc[i & 1][b]);
            if (fmt_has_min(f)) corr[b] += m * dx * (float)s32;
        }
    }
    for (int b = 0; b < NB; b++) out[b] = sum8(_mm256_add_ps(acc[0][b], acc[1][b])) + corr[b];
}


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
    if (f == FMT_MXFP4) *a = mxfp4_units(*a), *b = mxfp4_units(*b);
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
 * int16, <= 8 x 2 x 15 x 127 = 30,480 for 4-bit weights, 4 of 2 x 31 x 127 for 5-bit and of
 * 2 x 24 x 127 for MXFP4's units). */
#if !QUANT_VNNI
static inline __attribute__((always_inline)) void block_units_x8(Fmt32 f, const uint8_t *values, const int8_t *x[QROWS],
                                                                const int NB, __m256i sum[QROWS]) {
    const int five = f == FMT_Q5_0 || f == FMT_Q5_1 || f == FMT_MXFP4;
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
 * docs/performance.md, "Block formats in C". */
/* How far ahead of the block being multiplied the interleaved kernels ask for the weights
 * (software prefetch): at one row a matrix of a few hundred KB (an expert's) is read in less time
 * than the hardware prefetchers take to ramp up; 4 KB ahead took the experts kernel at one row from
 * 13 to 18-19 GB/s on a 2-core AVX2 machine, and the non-temporal hint (the weights are read once
 * per step) to 22-24 GB/s (docs/performance.md, "Block formats in C"). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif
/* The cache lines of `bytes` of weights PREFETCH_BYTES past p (a K-quant super-block of 8 rows). */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *p, const int bytes) {
    for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char *)p + PREFETCH_BYTES + l, _MM_HINT_NTA);
}
static inline __attribute__((always_inline)) void dot_units32x8(Fmt32 f, const uint8_t *grp, const QuantRows *q,
                                                               int64_t b0, const int NB, const int P,
                                                               float out[QROWS][IL]) {
    const int64_t blocks = q->k / 32, bytes = IL * fmt_bytes(f), vo = fmt_scales_bytes(f);
    const InputRows in = input_rows(q, b0, NB);
    __m256 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *blk = grp + i * bytes;
        /* every line of the block PREFETCH_BYTES ahead (two lines were the 4-bit blocks' 144 bytes
         * and left VNNI's 272-byte Q8_0 blocks half to the hardware: 15% slower at one row) */
        for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch((const char *)blk + PREFETCH_BYTES + l, _MM_HINT_NTA);
        const int8_t *x[QROWS];
        for (int b = 0; b < NB; b++) x[b] = in.hi[b] + 32 * i;
        __m256i sum[QROWS];
        block_units_x8(f, blk + vo, x, NB, sum);
        const __m256 d8 = scales_x8(f, blk);
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
                const __m256 d8 = scales_x8(f, blk);
                for (int b = 0; b < NB; b++)
                    acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(in.d[b][i])), _mm256_cvtepi32_ps(sum[b]), acc[b]);
            }
    for (int b = 0; b < NB; b++) _mm256_storeu_ps(out[b], acc[b]);
}

/* acc[b] (lane r: weight row 8 g + r) += group g . input row b0 + b, b < NB. */
/* P: the input's planes (1: its low plane is zero, and its products are skipped). */
static inline __attribute__((always_inline)) void dot_fmt32x8(Fmt32 f, const uint8_t *grp, const QuantRows *q,
                                                             int64_t b0, const int NB, const int P,
                                                             float out[QROWS][IL]) {
    const int64_t blocks = q->k / 32, bytes = IL * fmt_bytes(f);
    const InputRows in = input_rows(q, b0, NB);
    if (QUANT_VNNI || f != FMT_Q8_0) {
        dot_units32x8(f, grp, q, b0, NB, P, out);
        return;
    }
    /* Q8_0 without VNNI: the weights in pairs (Q8_0_X16's layout: chunk c holds values 2c, 2c + 1 of
     * the 8 rows), each chunk widened to int16 once for all NB rows and multiplied with X itself by
     * vpmaddwd (vpmaddubsw would saturate on Q8_0's range): a broadcast input pair times it gives
     * the 8 rows' partial sums in 8 lanes, no horizontal sums. |sum| <= 32 x 128 x 16129 < 2^31. */
    __m256 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *blk = grp + i * bytes, *values = blk + fmt_scales_bytes(f);
        for (int l = 0; l < 5; l++) _mm_prefetch((const char *)blk + PREFETCH_BYTES + 64 * l, _MM_HINT_NTA); /* 272 B */
        __m256i s[QROWS];
        for (int b = 0; b < NB; b++) s[b] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int c = 0; c < 16; c++) {
            const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(values + 16 * c)));
            for (int b = 0; b < NB; b++) {
                int32_t x2;
                memcpy(&x2, in.x16[b] + i * 32 + 2 * c, sizeof x2);
                s[b] = _mm256_add_epi32(s[b], _mm256_madd_epi16(w, _mm256_set1_epi32(x2)));
            }
        }
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        for (int b = 0; b < NB; b++)
            acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(in.d[b][i])), _mm256_cvtepi32_ps(s[b]), acc[b]);
    }
    for (int b = 0; b < NB; b++) _mm256_storeu_ps(out[b], acc[b]);
}

/* The K-quants' per-row finish of one super-block: acc (SIMD: the two input planes' integer
 * sums, combined in fp32, since 127 (w . hi) can pass 2^31 under Q6_K's 8-bit scales) or the
 * plain C sum over sub-blocks of `len` values, each scale[j] (v . X). */
static inline __m256 add_planes(__m256 acc, float scale, __m256i hi, __m256i lo) {
    acc = _mm256_fmadd_ps(_mm256_set1_ps(127.0f * scale), _mm256_cvtepi32_ps(hi), acc);
    return _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(lo), acc);
}

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
    for (int b = 0; b < NB; b++) acc_s[b] = sum8(acc[b]);
    for (int b = 0; b < NB; b++) out[b] = acc_s[b] + corr[b];
}

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
    for (int b = 0; b < NB; b++) acc_s[b] = sum8(acc[b]);
    for (int b = 0; b < NB; b++) out[b] = acc_s[b] + corr[b];
}

/* lane r of the result = the int8 at p[r] (r < 8), sign- or zero-extended */
static inline __m256i lanes_i8(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline __m256i lanes_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
/* each 32-bit lane's low int16 in both halves (vpmaddwd then scales a lane's two pair sums alike) */
static inline __m256i pairs16(__m256i v) { return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16)); }

/* lane r: the sum over j < n of w[j] (lane r) x s[j]: a K-quant super-block's mins or offsets (w,
 * converted once per pass) against one input row's fp32 sums over its sub-blocks (s). */
static inline __attribute__((always_inline)) __m256 weighted_sums(const __m256 *w, const float *s, const int n) {
    __m256 acc = _mm256_mul_ps(w[0], _mm256_broadcast_ss(s));
    for (int j = 1; j < n; j++) acc = _mm256_fmadd_ps(w[j], _mm256_broadcast_ss(s + j), acc);
    return acc;
}

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

/* The rows b < NB whose super-block i takes the low plane's products (P == 2 and its group loud):
 * their indices in order; returns how many. */
static inline __attribute__((always_inline)) int loud_rows(const InputRows *in, int64_t i, const int NB, const int P, int loud[QROWS]) {
    int n = 0;
    for (int b = 0; b < NB; b++)
        if (P == 2 && in->two[b][i]) loud[n++] = b;
    return n;
}

/* A K-quant super-block's low-plane products for the loud rows only, their planes gathered into the
 * first n slots (n a constant for each case, so the pass keeps its rows in registers without a test
 * per row and unit), then put back into sl. PASS(x, n, sums) is the super-block's pass over planes x. */
#define LOW_PLANE_PASS(PASS, in, loud, n, sl)                                                      \
    do {                                                                                           \
        const int8_t *lo_[QROWS];                                                                  \
        __m256i s_[QROWS];                                                                         \
        for (int c_ = 0; c_ < (n); c_++) lo_[c_] = (in).lo[(loud)[c_]], s_[c_] = _mm256_setzero_si256(); \
        switch (n) {                                                                               \
        case 1: PASS(lo_, 1, s_); break;                                                           \
        case 2: PASS(lo_, 2, s_); break;                                                           \
        case 3: PASS(lo_, 3, s_); break;                                                           \
        default: PASS(lo_, 4, s_); break;                                                          \
        }                                                                                          \
        for (int c_ = 0; c_ < (n); c_++) (sl)[(loud)[c_]] = s_[c_];                                \
    } while (0)

/* sums[b] += the super-block's 8 sub-blocks of one input plane (x[b] + off), each scaled by its
 * 6-bit scale in integers (vpmaddwd by the lane's scale). Sub-block j = 2m + h: nibble h of units
 * 8m .. 8m + 7. From 3 rows one sub-block at a time, so that only the NB rows' int16 sums stay in
 * registers beside the unit (both sub-blocks' 2 NB sums at once made GCC keep two on the stack, each
 * unit's adds then waiting on a store and a load; docs/performance.md, "Block formats in C"); at 1-2 rows
 * both from one load of the unit, unrolled by 4 (one sub-block at a time, or unrolled by 8, was 5-10%
 * slower at 2 rows). Int16 pair sums: 8 x 2 x 15 x 127 = 30,480 at most. */
static inline __attribute__((always_inline)) void q4k_plane_x8(const uint8_t *units, const uint8_t sc[64], const int8_t *const x[QROWS],
                                                              int64_t off, const int NB, __m256i sums[QROWS]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    if (NB <= 2) { /* few rows (decode): both sub-blocks from each load of a unit, 2 NB sums in registers */
        for (int m = 0; m < 4; m++) {
            const uint8_t *u8 = units + 32 * 8 * m;
            __m256i t[2][QROWS];
            for (int b = 0; b < NB; b++) t[0][b] = t[1][b] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int u = 0; u < 8; u++) {
                const __m256i v = load_i8(u8 + 32 * u);
                const __m256i w0 = _mm256_and_si256(v, m4), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                for (int b = 0; b < NB; b++) {
                    const int8_t *xb = x[b] + off + 64 * m + 4 * u;
                    t[0][b] = _mm256_add_epi16(t[0][b], _mm256_maddubs_epi16(w0, bcast4(xb)));
                    t[1][b] = _mm256_add_epi16(t[1][b], _mm256_maddubs_epi16(w1, bcast4(xb + 32)));
                }
            }
            for (int h = 0; h < 2; h++) {
                const __m256i s16 = pairs16(lanes_u8(sc + 8 * (2 * m + h)));
                for (int b = 0; b < NB; b++) sums[b] = _mm256_add_epi32(sums[b], _mm256_madd_epi16(t[h][b], s16));
            }
        }
        return;
    }
    for (int j = 0; j < 8; j++) {
        const int h = j & 1;
        const uint8_t *u8 = units + 32 * 8 * (j >> 1);
        __m256i t[QROWS];
        for (int b = 0; b < NB; b++) t[b] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int u = 0; u < 8; u++) {
            const __m256i v = load_i8(u8 + 32 * u);
            const __m256i w = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, m4);
            for (int b = 0; b < NB; b++) t[b] = _mm256_add_epi16(t[b], _mm256_maddubs_epi16(w, bcast4(x[b] + off + 32 * j + 4 * u)));
        }
        const __m256i s16 = pairs16(lanes_u8(sc + 8 * j));
        for (int b = 0; b < NB; b++) sums[b] = _mm256_add_epi32(sums[b], _mm256_madd_epi16(t[b], s16));
    }
}

/* out[b][r] = row 8 g + r of the group . input row b0 + b, b < NB (Q4_K). Per super-block and row
 * the sub-block sums of the two planes are scaled in integers; the mins come off as dmin (sum over
 * sub-blocks of mn X-sums), from the input's sums. */
static inline __attribute__((always_inline)) void dot_q4_kx8_madd(const uint8_t *grp, const QuantRows *q, int64_t b0,
                                                                 const int NB, const int P, float out[QROWS][IL]) {
    const int64_t supers = q->k / 256;
    const InputRows in = input_rows(q, b0, NB);
    __m256 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();
    for (int64_t i = 0; i < supers; i++) {
        const uint8_t *blk = grp + i * Q4K_X8, *units = blk + 128;
        prefetch_ahead(blk, Q4K_X8);
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 dm8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        uint8_t sc[64], mn[64];
        q4k_scales_x8(blk, sc, mn);
        __m256i sh[QROWS], sl[QROWS]; /* the two planes' scaled sums: |sh| <= 8 x 63 x 32 x 15 x 127 < 2^25 */
        for (int b = 0; b < NB; b++) sh[b] = sl[b] = _mm256_setzero_si256();
        /* the high plane of every row, then the low plane of the loud rows only (a quiet row's is zeros) */
        q4k_plane_x8(units, sc, in.hi, i * 256, NB, sh);
        int loud[QROWS];
        const int n_loud = loud_rows(&in, i, NB, P, loud);
#define Q4K_LOW(x, n, sums) q4k_plane_x8(units, sc, x, i * 256, n, sums)
        if (n_loud) LOW_PLANE_PASS(Q4K_LOW, in, loud, n_loud, sl);
#undef Q4K_LOW
        /* the mins: sum over sub-blocks j of mn[j] (per row) times the input's sum over j's values
         * (fp32, kept by quantize_rows: a scalar conversion each here cost 5-10% of the kernel), the
         * mins converted once for all NB rows (in integers from the input planes' sums: level or 3-5%
         * slower, docs/performance.md, "Block formats in C") */
        __m256 mnf[8];
        for (int j = 0; j < 8; j++) mnf[j] = _mm256_cvtepi32_ps(lanes_u8(mn + 8 * j));
        for (int b = 0; b < NB; b++) {
            const float dx = in.d[b][i];
            const __m256 msum = weighted_sums(mnf, in.s32[b] + i * 8, 8);
            const __m256 s = _mm256_fmadd_ps(_mm256_set1_ps(127.0f), _mm256_cvtepi32_ps(sh[b]), _mm256_cvtepi32_ps(sl[b]));
            acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(dx)), s, acc[b]);
            acc[b] = _mm256_fnmadd_ps(_mm256_mul_ps(dm8, _mm256_set1_ps(dx)), msum, acc[b]);
        }
    }
    for (int b = 0; b < NB; b++) _mm256_storeu_ps(out[b], acc[b]);
}

#if !QUANT_VNNI
static inline __attribute__((always_inline)) void dot_q4_kx8(const uint8_t *grp, const QuantRows *q, int64_t b0,
                                                            const int NB, const int P, float out[QROWS][IL]) {
    dot_q4_kx8_madd(grp, q, b0, NB, P, out);
}

/* The same for Q6_K: values 0..63 (the -32 comes off as 32 (sum over sub-blocks of scale x X-sum)).
 * sum[b] += sub-block j's products with input plane x[b] (16 values at x[b] + off), scaled by s16:
 * int16 pair sums of two chunks, 2 x 2 x 63 x 127 = 32,004 at most. */
static inline __attribute__((always_inline)) void q6k_sub_x8(const __m256i w[4], __m256i s16, const int8_t *const x[QROWS],
                                                            int64_t off, const int NB, __m256i sum[QROWS]) {
    for (int b = 0; b < NB; b++)
        for (int c = 0; c < 4; c += 2) {
            const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(w[c], bcast4(x[b] + off + 4 * c)),
                                               _mm256_maddubs_epi16(w[c + 1], bcast4(x[b] + off + 4 * c + 4)));
            sum[b] = _mm256_add_epi32(sum[b], _mm256_madd_epi16(t, s16));
        }
}

/* Sub-block j's 4 chunks of 8 rows x 4 values (values 16 j + 4 c + 0..3 of each row), unsigned 0..63
 * (the high bits masked after the 16-bit shifts, so no bit crosses into the next byte). */
static inline __attribute__((always_inline)) void q6k_units_x8(const uint8_t *sub_block, __m256i w[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i u0 = load_i8(sub_block), u1 = load_i8(sub_block + 32), h = load_i8(sub_block + 64);
    w[0] = _mm256_or_si256(_mm256_and_si256(u0, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
    w[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(u0, 4), m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
    w[2] = _mm256_or_si256(_mm256_and_si256(u1, m4), _mm256_and_si256(h, m30));
    w[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(u1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
}

static inline __attribute__((always_inline)) void dot_q6_kx8(const uint8_t *grp, const QuantRows *q, int64_t b0,
                                                            const int NB, const int P, float out[QROWS][IL]) {
    const int64_t supers = q->k / 256;
    const InputRows in = input_rows(q, b0, NB);
    __m256 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();
    for (int64_t i = 0; i < supers; i++) {
        const uint8_t *blk = grp + i * Q6K_X8, *scales = blk + 16, *units = blk + 144;
        prefetch_ahead(blk, Q6K_X8);
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256i sh[QROWS], sl[QROWS]; /* |sh| <= 16 x 128 x 16 x 63 x 127 < 2^29 */
        for (int b = 0; b < NB; b++) sh[b] = sl[b] = _mm256_setzero_si256();
        /* the high plane of every row, then the low plane of the loud rows only (in a pass of its
         * own: the registers, and no test per sub-block and row) */
#define Q6K_PASS(x, n, sums)                                                              \
        for (int j = 0; j < 16; j++) {                                                    \
            __m256i w[4];                                                                 \
            q6k_units_x8(units + 96 * j, w);                                              \
            q6k_sub_x8(w, pairs16(lanes_i8(scales + 8 * j)), x, i * 256 + 16 * j, n, sums); \
        }
        Q6K_PASS(in.hi, NB, sh)
        int loud[QROWS];
        const int n_loud = loud_rows(&in, i, NB, P, loud);
        if (n_loud) LOW_PLANE_PASS(Q6K_PASS, in, loud, n_loud, sl);
#undef Q6K_PASS
        /* the offset: lane r's sum over sub-blocks j of scale[j][r] x the input's sum there (fp32,
         * kept by quantize_rows; a scalar conversion each had been 15% of the kernel), the scales
         * converted once for all NB rows */
        __m256 scf[16];
        for (int j = 0; j < 16; j++) scf[j] = _mm256_cvtepi32_ps(lanes_i8(scales + 8 * j));
        for (int b = 0; b < NB; b++) {
            const __m256 off = weighted_sums(scf, in.s16f[b] + i * 16, 16);
            __m256 s = _mm256_fmadd_ps(_mm256_set1_ps(127.0f), _mm256_cvtepi32_ps(sh[b]), _mm256_cvtepi32_ps(sl[b]));
            s = _mm256_fnmadd_ps(_mm256_set1_ps(32.0f), off, s);
            acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(in.d[b][i])), s, acc[b]);
        }
    }
    for (int b = 0; b < NB; b++) _mm256_storeu_ps(out[b], acc[b]);
}
#endif

/* out[b] = f16 row w . x[b] (fp32), b < NB. */
static inline __attribute__((always_inline)) void dot_f16(const uint16_t *w, const float *x, int64_t ldx, int64_t k,
                                                         const int NB, float *out) {
    int64_t i = 0;
    float s[QROWS] = {0};
    __m256 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();
    for (; i + 8 <= k; i += 8) {
        const __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i)));
        for (int b = 0; b < NB; b++) acc[b] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + b * ldx + i), acc[b]);
    }
    for (int b = 0; b < NB; b++) s[b] = sum8(acc[b]);
    for (; i < k; i++)
        for (int b = 0; b < NB; b++) s[b] += f16_to_f32(w[i]) * x[b * ldx + i];
    for (int b = 0; b < NB; b++) out[b] = s[b];
}

/* out[b] = e4m3 row w . x[b] (fp32), b < NB: per block, the 32 products summed, then scaled. */
static inline __attribute__((always_inline)) void dot_e4m3(const uint8_t *w, const float *x, int64_t ldx, int64_t k,
                                                          const int NB, float *out) {
    float s[QROWS] = {0};
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
    for (int b = 0; b < NB; b++) s[b] = sum8(acc[b]);
    for (int b = 0; b < NB; b++) out[b] = s[b];
}
