/* The KV cache's storage formats (cpu_kernels.h, KV_*): a row's bytes, and storing rows into them.
 * kv_store_row: one head's K or V row into its format, rounded as layers/backends/kv_formats.py
 * rounds it (the tests compare the bytes); the reading side is cpu_kv_formats.h. */
#include <math.h>
#include <string.h>

#include "cpu_kernels.h"

int64_t kv_row_bytes(int64_t kv_type, int64_t head_dim) {
    if (head_dim <= 0) return 0;
    switch (kv_type) {
    case KV_F32: return 4 * head_dim;
    case KV_BF16:
    case KV_F16: return 2 * head_dim;
    case KV_Q8_0: return head_dim % 32 == 0 ? head_dim / 32 * 34 : 0;
    case KV_E4M3:
    case KV_E5M2: return head_dim;
    default: return 0;
    }
}

/* ---- the formats: storing a row ------------------------------------------------------------------
 * Round to nearest even from the fp32 bits, as torch's conversions do (c10's Half, BFloat16,
 * Float8_e4m3fn and Float8_e5m2). */
static inline uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static inline uint16_t f32_to_bf16(float x) {
    const uint32_t u = f32_bits(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0; /* NaN */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* A finite |x| of bits a, smaller than the format's smallest normal 2^emin: the subnormal count
 * of steps 2^(emin - mant_bits) (the power-of-two product is exact; nearbyintf rounds to even). */
static inline uint32_t subnormal_steps(float ax, float inv_step) { return (uint32_t)nearbyintf(ax * inv_step); }

/* The normal encoding of bits a (sign cleared) with the exponent rebiased by `rebias` and `drop`
 * mantissa bits rounded off to nearest even; a carry runs into the exponent. */
static inline uint32_t round_normal(uint32_t a, uint32_t rebias, int drop) {
    return (a - (rebias << 23) + ((1u << (drop - 1)) - 1u) + ((a >> drop) & 1u)) >> drop;
}

static inline uint16_t f32_to_f16(float x) {
    const uint32_t u = f32_bits(x), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);  /* NaN */
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* rounds to 65520 or more: inf */
    if (a < 0x38800000u) return (uint16_t)(sign | subnormal_steps(fabsf(x), 16777216.0f)); /* < 2^-14 */
    return (uint16_t)(sign | round_normal(a, 112, 13));
}

/* fp8: values clamped to the largest finite one first (kv_formats.py's `limit`); below the smallest
 * normal (bits min_normal) in subnormal steps of 1 / inv_step; else rebiased, `drop` mantissa bits off. */
static inline uint8_t f32_to_fp8(float x, float limit, uint32_t min_normal, float inv_step, uint32_t rebias, int drop) {
    if (isnan(x)) return 0x7F;
    x = x > limit ? limit : x < -limit ? -limit : x;
    const uint32_t u = f32_bits(x), sign = (u >> 24) & 0x80u, a = u & 0x7FFFFFFFu;
    if (a < min_normal) return (uint8_t)(sign | subnormal_steps(fabsf(x), inv_step));
    return (uint8_t)(sign | round_normal(a, rebias, drop));
}

static inline uint8_t f32_to_e4m3(float x) { return f32_to_fp8(x, 448.0f, 0x3C800000u, 512.0f, 120, 20); }   /* 2^-6 */
static inline uint8_t f32_to_e5m2(float x) { return f32_to_fp8(x, 57344.0f, 0x38800000u, 65536.0f, 112, 21); } /* 2^-14 */

/* ggml's quantize_row_q8_0_ref: d = max|x| / 127 stored as fp16, q = roundf(x / d) with 1 / d in fp32. */
static void store_q8_0(uint8_t *dst, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i += 32, dst += 34) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[i + j]));
        const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
        const uint16_t h = f32_to_f16(d);
        memcpy(dst, &h, sizeof h);
        for (int j = 0; j < 32; j++) dst[2 + j] = (uint8_t)(int8_t)roundf(x[i + j] * inv);
    }
}

void kv_store_row(int64_t kv_type, void *dst, const float *x, int64_t head_dim) {
    uint8_t *o = dst;
    switch (kv_type) {
    case KV_F32: memcpy(dst, x, sizeof(float) * (size_t)head_dim); break;
    case KV_BF16:
    case KV_F16:
        for (int64_t d = 0; d < head_dim; d++) {
            const uint16_t h = kv_type == KV_BF16 ? f32_to_bf16(x[d]) : f32_to_f16(x[d]);
            memcpy(o + 2 * d, &h, sizeof h);
        }
        break;
    case KV_Q8_0: store_q8_0(o, x, head_dim); break;
    case KV_E4M3:
        for (int64_t d = 0; d < head_dim; d++) o[d] = f32_to_e4m3(x[d]);
        break;
    case KV_E5M2:
        for (int64_t d = 0; d < head_dim; d++) o[d] = f32_to_e5m2(x[d]);
        break;
    default: break;
    }
}

/* Stores rows [0, n) of k and v ([n, num_kv_heads, head_dim] fp32, token stride ldk / ldv floats)
 * into their cache slots (slot < 0: not stored). */
int kv_store_rows(int64_t kv_type, const float *k, int64_t ldk, const float *v, int64_t ldv, const int64_t *slots,
                  int64_t n, void *k_cache, void *v_cache, int64_t num_kv_heads, int64_t head_dim, int num_threads) {
    const int64_t row = kv_row_bytes(kv_type, head_dim);
    if (row == 0) return 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < n * num_kv_heads; i++) {
        const int64_t t = i / num_kv_heads, h = i % num_kv_heads;
        if (slots[t] < 0) continue;
        const int64_t at = (slots[t] * num_kv_heads + h) * row;
        kv_store_row(kv_type, (uint8_t *)k_cache + at, k + t * ldk + h * head_dim, head_dim);
        kv_store_row(kv_type, (uint8_t *)v_cache + at, v + t * ldv + h * head_dim, head_dim);
    }
    return 0;
}
