/* The 512-bit VNNI bodies of cpu_quant.c (AVX512-VNNI + BW, included where QUANT_VNNI512): the
 * interleaved kernels that multiply two 8-row groups at once, one row per 32-bit lane of a zmm
 * register (the row loops pair the groups, DEFINE_X8_LINEAR_ROWS_W). */

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
        __m512 mnf[8];
        for (int j = 0; j < 8; j++) mnf[j] = _mm512_cvtepi32_ps(lanes_u8x16(ma + 8 * j, mb + 8 * j));
        for (int b = 0; b < NB; b++) {
            const float dx = in.d[b][i];
            const float *s32 = in.s32[b] + i * 8; /* (fp32 sums: no scalar conversion per sub-block and row) */
            __m512 msum = _mm512_setzero_ps();
            for (int j = 0; j < 8; j++) msum = _mm512_fmadd_ps(mnf[j], _mm512_set1_ps(s32[j]), msum);
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
        __m512 scf[16];
        for (int j = 0; j < 16; j++) scf[j] = _mm512_cvtepi32_ps(lanes_i8x16(ba + 16 + 8 * j, bb + 16 + 8 * j));
        for (int b = 0; b < NB; b++) {
            const float dx = in.d[b][i];
            const float *s16f = in.s16f[b] + i * 16;
            __m512 off = _mm512_setzero_ps();
            for (int j = 0; j < 16; j++) off = _mm512_fmadd_ps(scf[j], _mm512_set1_ps(s16f[j]), off);
            acc[b] = _mm512_fmadd_ps(_mm512_mul_ps(d16, _mm512_set1_ps(dx)), _mm512_fnmadd_ps(_mm512_set1_ps(32.0f), off, sub[b]), acc[b]);
        }
    }
    for (int b = 0; b < NB; b++) _mm512_storeu_ps(out[b], acc[b]);
}
