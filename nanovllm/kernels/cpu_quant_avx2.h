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
