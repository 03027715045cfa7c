/* The KV cache's storage formats (cpu_kernels.h, KV_*) as the attention reads them: 8 values (or
 * one) of a cached row as fp32, from registers (no fp32 copy of the cache is made). The formats'
 * bytes and their rounding (kv_store_row) are in cpu_kv_formats.c; the torch side of the same
 * formats is layers/backends/kv_formats.py. Included by the attention kernels (cpu_attention.c,
 * cpu_prefill_attention.c). */
#ifndef NANOVLLM_CPU_KV_FORMATS_H
#define NANOVLLM_CPU_KV_FORMATS_H

#include <string.h>
#include "cpu_kernels.h"

#define KV_F16C (ISA_AVX2 && ISA_F16C)

float nanovllm_f16_to_f32(uint16_t h); /* cpu_quant.c */

/* ---- the formats: reading 8 values (or one) of a row as fp32 ---------------------------------- */

/* An e4m3 byte's sign to bit 15 and its exponent and mantissa up by 7 is the fp16 of its value
 * times 2^-8 (fp16's exponent bias is 8 more; subnormals map onto subnormals). */
static inline uint16_t e4m3_bits_as_f16(uint8_t b) { return (uint16_t)(((b & 0x80) << 8) | ((b & 0x7F) << 7)); }

#if KV_F16C
static inline vf bf16x8(const uint8_t *p) {
    return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf i8x8(const uint8_t *p) {
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vf f16x8(const uint8_t *p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline float f16x1(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}
static inline vf e5m2x8(const uint8_t *p) {
    return (vf)_mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8));
}
static inline vf e4m3x8(const uint8_t *p) {
    const __m128i v = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x7F)), 7));
    return (vf)_mm256_cvtph_ps(h) * 256.0f;
}
#else
typedef uint16_t vh __attribute__((vector_size(2 * VL)));
typedef uint32_t vu __attribute__((vector_size(4 * VL)));
typedef int8_t vb __attribute__((vector_size(VL)));
static inline vf bf16x8(const uint8_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}
static inline vf i8x8(const uint8_t *p) {
    vb b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, vf);
}
static inline float f16x1(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return nanovllm_f16_to_f32(h);
}
static inline vf f16x8(const uint8_t *p) {
    vf v;
    for (int i = 0; i < VL; i++) v[i] = f16x1(p + 2 * i);
    return v;
}
static inline vf e5m2x8(const uint8_t *p) {
    vf v;
    for (int i = 0; i < VL; i++) v[i] = nanovllm_f16_to_f32((uint16_t)(p[i] << 8));
    return v;
}
static inline vf e4m3x8(const uint8_t *p) {
    vf v;
    for (int i = 0; i < VL; i++) v[i] = nanovllm_f16_to_f32(e4m3_bits_as_f16(p[i])) * 256.0f;
    return v;
}
#endif

/* Values [d, d + 8) of a row (d a multiple of 8). `type` is a constant in every caller's
 * instantiation (KV_BODIES), so the switch folds away. */
static inline __attribute__((always_inline)) vf kv_load8(const int type, const uint8_t *row, int64_t d) {
    switch (type) {
    case KV_F32: return load_f32((const float *)row + d);
    case KV_BF16: return bf16x8(row + 2 * d);
    case KV_F16: return f16x8(row + 2 * d);
    case KV_Q8_0: {
        const uint8_t *blk = row + ((uint64_t)d >> 5) * 34; /* d >= 0 */
        return f16x1(blk) * i8x8(blk + 2 + (d & 31));
    }
    case KV_E4M3: return e4m3x8(row + d);
    default: return e5m2x8(row + d);
    }
}

/* Value d of a row (the tails of a head_dim that is not a multiple of 8; not q8_0, whose rows are
 * whole blocks of 32). */
static inline __attribute__((always_inline)) float kv_load1(const int type, const uint8_t *row, int64_t d) {
    switch (type) {
    case KV_F32: return ((const float *)row)[d];
    case KV_BF16: {
        uint16_t h;
        memcpy(&h, row + 2 * d, sizeof h);
        return scalar_bf16(h);
    }
    case KV_F16: return f16x1(row + 2 * d);
    case KV_Q8_0: return f16x1(row + d / 32 * 34) * (float)(int8_t)row[d / 32 * 34 + 2 + d % 32];
    case KV_E4M3: return nanovllm_f16_to_f32(e4m3_bits_as_f16(row[d])) * 256.0f;
    default: return nanovllm_f16_to_f32((uint16_t)(row[d] << 8));
    }
}

#endif
