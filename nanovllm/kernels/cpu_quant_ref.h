/* The plain C reference bodies of cpu_quant.c: the build of CPUs without AVX2 + FMA + F16C, and
 * what the tests compare the vector code with (the same integers). */

/* One input row quantized (quantize_rows): hr, lr, d, two, sums are the row's own; xr16 unused (the
 * int16 copy is the vector kernels'). */
static void quantize_row_ref(const float *xr, int64_t k, int64_t group, int mode, int8_t *hr, int8_t *lr,
                               int16_t *xr16, float *d, uint8_t *two, int32_t *sums) {
    const int64_t groups = k / group, sixteens = k / 16;
    (void)xr16;
    for (int64_t g = 0; g < groups; g++) {
        const float *xg = xr + g * group;
        float amax = 0.0f, ss[8] = {0};
        for (int64_t i = 0; i < group; i++) {
            amax = fmaxf(amax, fabsf(xg[i]));
            ss[i % 8] = fmaf(xg[i], xg[i], ss[i % 8]); /* the vector code's lanes and order */
        }
        const float inv = amax > 0.0f ? (float)XMAX / amax : 0.0f;
        d[g] = amax / (float)XMAX;
        const float s4[4] = {ss[0] + ss[4], ss[1] + ss[5], ss[2] + ss[6], ss[3] + ss[7]};
        two[g] = two_planes(mode, amax, (s4[0] + s4[2]) + (s4[1] + s4[3]), group);
        for (int64_t i = 0; i < group; i++) {
            if (!two[g]) {
                const float v = nearbyintf(xg[i] * (amax > 0.0f ? 127.0f / amax : 0.0f));
                hr[g * group + i] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
                lr[g * group + i] = 0;
                continue;
            }
            const float v = nearbyintf(xg[i] * inv);
            const int32_t X = (int32_t)(v > XMAX ? XMAX : v < -XMAX ? -XMAX : v);
            const int32_t h = (X >= 0 ? X + 63 : X - 63) / 127; /* nearest, so |X - 127 h| <= 63 */
            hr[g * group + i] = (int8_t)h;
            lr[g * group + i] = (int8_t)(X - 127 * h);
        }
    }
    for (int64_t s = 0; s < sixteens; s++) {
        int32_t sum = 0;
        for (int i = 0; i < 16; i++) sum += 127 * hr[s * 16 + i] + lr[s * 16 + i];
        sums[s] = sum;
    }
}

#if !QUANT_SIMD
/* ---- the kernels of CPUs without AVX2 + FMA + F16C ---------------------------------------- */

/* IEEE half -> float (subnormals, infinities and NaNs included). */
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

/* out[b] = row w . input row b0 + b, for b < NB. */
static inline __attribute__((always_inline)) void dot_fmt32(Fmt32 f, const uint8_t *w, const QuantRows *q, int64_t b0,
                                                           const int NB, float *out) {
    const int64_t blocks = q->k / 32, bytes = fmt_bytes(f);
    const InputRows in = input_rows(q, b0, NB);
    float corr[QROWS] = {0};
    float acc[QROWS] = {0};
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *blk = w + i * bytes;
        const float d = fmt_scale(f, blk);
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


/* acc[b] (lane r: weight row 8 g + r) += group g . input row b0 + b, b < NB. */
/* P: the input's planes (1: its low plane is zero, and its products are skipped). */
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
            const float d = fmt_scale(f, plain);
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

/* The K-quants' per-row finish of one super-block: acc (SIMD: the two input planes' integer
 * sums, combined in fp32, since 127 (w . hi) can pass 2^31 under Q6_K's 8-bit scales) or the
 * plain C sum over sub-blocks of `len` values, each scale[j] (v . X). */
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

/* out[b][r] = row 8 g + r of the group . input row b0 + b, b < NB (Q4_K). Per super-block and row
 * the sub-block sums of the two planes are scaled in integers (vpmaddwd by the lane's scale) or, with
 * VNNI, in fp32; the mins come off as dmin (sum over sub-blocks of mn X-sums), from the input's sums. */
static inline __attribute__((always_inline)) void dot_q4_kx8(const uint8_t *grp, const QuantRows *q, int64_t b0,
                                                            const int NB, const int P, float out[QROWS][IL]) {
    (void)P;
    dot_kx8_plain(0, grp, q, b0, NB, out);
}

/* The same for Q6_K: values 0..63 (the -32 comes off as 32 (sum over sub-blocks of scale x X-sum)). */
static inline __attribute__((always_inline)) void dot_q6_kx8(const uint8_t *grp, const QuantRows *q, int64_t b0,
                                                            const int NB, const int P, float out[QROWS][IL]) {
    (void)P;
    dot_kx8_plain(1, grp, q, b0, NB, out);
}

/* out[b] = f16 row w . x[b] (fp32), b < NB. */
static inline __attribute__((always_inline)) void dot_f16(const uint16_t *w, const float *x, int64_t ldx, int64_t k,
                                                         const int NB, float *out) {
    int64_t i = 0;
    float s[QROWS] = {0};
    for (; i < k; i++)
        for (int b = 0; b < NB; b++) s[b] += f16_to_f32(w[i]) * x[b * ldx + i];
    for (int b = 0; b < NB; b++) out[b] = s[b];
}

/* out[b] = e4m3 row w . x[b] (fp32), b < NB: per block, the 32 products summed, then scaled. */
static inline __attribute__((always_inline)) void dot_e4m3(const uint8_t *w, const float *x, int64_t ldx, int64_t k,
                                                          const int NB, float *out) {
    float s[QROWS] = {0};
    for (int64_t i = 0; i < k; i += 32, w += 36) {
        float d;
        memcpy(&d, w, sizeof d);
        for (int b = 0; b < NB; b++) {
            float p = 0.0f;
            for (int j = 0; j < 32; j++) p += f16_to_f32(e4m3_as_f16(w[4 + j])) * x[b * ldx + i + j];
            s[b] += d * p;
        }
    }
    for (int b = 0; b < NB; b++) out[b] = s[b];
}
#endif
