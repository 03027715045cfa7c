/* What this build's instruction sets are, said once: the only file under kernels/ that names the
 * compiler's instruction-set macros (tests/tools/test_structure.py holds that). Every other file
 * tests these ISA_* values (each 0 or 1), so a build's choices are read in one place. */
#ifndef NANOVLLM_ISA_H
#define NANOVLLM_ISA_H

#if defined(__AVX2__)
#define ISA_AVX2 1
#else
#define ISA_AVX2 0
#endif
#if defined(__FMA__)
#define ISA_FMA 1
#else
#define ISA_FMA 0
#endif
#if defined(__F16C__)
#define ISA_F16C 1
#else
#define ISA_F16C 0
#endif
#if defined(__AVX512F__)
#define ISA_AVX512F 1
#else
#define ISA_AVX512F 0
#endif
#if defined(__AVX512BW__)
#define ISA_AVX512BW 1
#else
#define ISA_AVX512BW 0
#endif
#if defined(__AVX512VL__)
#define ISA_AVX512VL 1
#else
#define ISA_AVX512VL 0
#endif
#if defined(__AVX512VNNI__)
#define ISA_AVX512VNNI 1
#else
#define ISA_AVX512VNNI 0
#endif
#if defined(__AVXVNNI__)
#define ISA_AVXVNNI 1
#else
#define ISA_AVXVNNI 0
#endif

/* 256-bit vpdpbusd (u8 x s8 products summed into 32-bit lanes): AVX512-VNNI with VL, or AVX-VNNI */
#define ISA_VNNI256 ((ISA_AVX512VNNI && ISA_AVX512VL) || ISA_AVXVNNI)

#if ISA_AVX2
#include <immintrin.h>
#endif

/* acc + the u8 x s8 products of u and s, 4 per 32-bit lane: vpdpbusd in the encoding this build has
 * (EVEX with AVX512-VNNI + VL, else AVX-VNNI's VEX). */
#if ISA_AVX512VNNI && ISA_AVX512VL
static inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif ISA_AVXVNNI
static inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif

#endif
