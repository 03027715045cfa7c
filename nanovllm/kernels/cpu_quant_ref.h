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
