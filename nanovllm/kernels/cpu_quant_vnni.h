/* The VNNI bodies of cpu_quant.c (vpdpbusd on 256-bit registers, AVX512-VNNI + VL or AVX-VNNI):
 * included where QUANT_VNNI, after the AVX2 baseline (cpu_quant_avx2.h) whose helpers they use and
 * whose maddubs versions of these functions they replace. */

static inline __m256i dot_us(__m256i u, __m256i s) { return dpbusd256(_mm256_setzero_si256(), u, s); }
static inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) { return dpbusd256(acc, u, s); }


/* sum[b] (b < NB; lane r: row r of the group) = the integer products of one block's units (values at
 * `values`) with 32 values of an input plane at x[b] (without VNNI: vpmaddubsw pair sums added in
 * int16, <= 8 x 2 x 15 x 127 = 30,480 for 4-bit weights, 4 of 2 x 31 x 127 for 5-bit). */
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

/* out[b][r] = row 8 g + r of the group . input row b0 + b, b < NB (Q4_K). Per super-block and row
 * the sub-block sums of the two planes are scaled in integers (vpmaddwd by the lane's scale) or, with
 * VNNI, in fp32; the mins come off as dmin (sum over sub-blocks of mn X-sums), from the input's sums. */
static inline __attribute__((always_inline)) void dot_q4_kx8(const uint8_t *grp, const QuantRows *q, int64_t b0,
                                                            const int NB, const int P, float out[QROWS][IL]) {
    /* at 1-2 rows (decode) the vpmaddubsw kernel, its sub-blocks scaled in integers, is ~13% faster
     * here than this one's conversion per sub-block and row (docs/performance.md, "Block formats in C") */
    if (NB <= 2) {
        dot_q4_kx8_madd(grp, q, b0, NB, P, out);
        return;
    }
    const int64_t supers = q->k / 256;
    const InputRows in = input_rows(q, b0, NB);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();
    for (int64_t i = 0; i < supers; i++) {
        const uint8_t *blk = grp + i * Q4K_X8, *units = blk + 128;
        prefetch_ahead(blk, Q4K_X8);
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
        __m256 mnf[8];
        for (int j = 0; j < 8; j++) mnf[j] = _mm256_cvtepi32_ps(lanes_u8(mn + 8 * j));
        for (int b = 0; b < NB; b++) {
            const float dx = in.d[b][i];
            const __m256 msum = weighted_sums(mnf, in.s32[b] + i * 8, 8); /* (fp32 sums: no scalar conversion per sub-block and row) */
            const __m256 s = sub[b];
            acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(dx)), s, acc[b]);
            acc[b] = _mm256_fnmadd_ps(_mm256_mul_ps(dm8, _mm256_set1_ps(dx)), msum, acc[b]);
        }
    }
    for (int b = 0; b < NB; b++) _mm256_storeu_ps(out[b], acc[b]);
}

/* The same for Q6_K: values 0..63 (the -32 comes off as 32 (sum over sub-blocks of scale x X-sum)). */
static inline __attribute__((always_inline)) void dot_q6_kx8(const uint8_t *grp, const QuantRows *q, int64_t b0,
                                                            const int NB, const int P, float out[QROWS][IL]) {
    const int64_t supers = q->k / 256;
    const InputRows in = input_rows(q, b0, NB);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    __m256 acc[QROWS];
    for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();
    for (int64_t i = 0; i < supers; i++) {
        const uint8_t *blk = grp + i * Q6K_X8, *scales = blk + 16, *units = blk + 144;
        prefetch_ahead(blk, Q6K_X8);
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
        __m256 scf[16];
        for (int j = 0; j < 16; j++) scf[j] = _mm256_cvtepi32_ps(lanes_i8(scales + 8 * j));
        for (int b = 0; b < NB; b++) {
            const float dx = in.d[b][i];
            const __m256 off = weighted_sums(scf, in.s16f[b] + i * 16, 16);
            __m256 s = sub[b];
            s = _mm256_fnmadd_ps(_mm256_set1_ps(32.0f), off, s);
            acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(dx)), s, acc[b]);
        }
    }
    for (int b = 0; b < NB; b++) _mm256_storeu_ps(out[b], acc[b]);
}
