/* CPU kernels in C: linear layers over a few rows, the weight-type table and the ABI checks
 * (decode attention is cpu_attention.c, the block formats cpu_quant.c).
 *
 * linear_f32: y = x W^T (+ bias) for a few rows x (decode batches), W in any format of the
 * weight-type table (weight_types, below linear_rows_for's helpers), each a row of block size,
 * bytes per block, row dot product and row-to-fp32.
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

/* dst[0..n) = the bf16 values src[0..n) as fp32 (exact: bf16 is the top half of an fp32). */
static void widen_bf16_from(const uint16_t *src, int64_t i, int64_t n, float *dst) {
    for (; i + VL <= n; i += VL) store_f32(dst + i, load_bf16(src + i));
    for (; i < n; i++) dst[i] = scalar_bf16(src[i]);
}
#if ISA_AVX512F
static void widen_bf16(const uint16_t *src, int64_t n, float *dst) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_si512(dst + i,
                            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i))), 16));
    widen_bf16_from(src, i, n, dst);
}
#else
static void widen_bf16(const uint16_t *src, int64_t n, float *dst) { widen_bf16_from(src, 0, n, dst); }
#endif

/* ---- linear layers over a few rows ------------------------------------------------------------
 * Decode batches of 1-2 rows beside a packed copy for oneDNN (bf16 weights: oneDNN reads its packed
 * fp32 copy at bandwidth from 4 rows up), 1-16 rows of fp32 weights held once (MKL above), a MoE
 * expert's tokens. Each thread takes a contiguous range of weight rows (static schedule), TILE_W at a
 * time: a tile of TILE_W weight rows x NB <= STREAM_ROWS input rows loads TILE_W + NB vectors per
 * TILE_W * NB FMAs (more input rows: the wider passes below, which reread the tile from L1). AVX2's 16
 * registers hold a 2 x 4 tile's 8 sums, 2 weight vectors and an input vector; AVX-512's 32 (8-lane
 * vectors) a 4 x 4 tile's. The next tile's rows (wn) are prefetched a cache line per line read:
 * otherwise a tile's memory reads and its FMAs take turns rather than overlapping
 * (docs/performance.md, "The dense C tiles"). GCC vector types of VL lanes, so one source serves AVX2 and AVX-512
 * (-march=native). */

#define IDENTITY(v) (v)

/* Tile shapes by input rows. At one row the tile is one weight row wide: each thread then reads its
 * rows as one forward stream, prefetched into L1 (docs/performance.md, "The dense C tiles"). From 2 rows it is
 * TILE_W wide and the next tile is prefetched into L2 only: prefetched into L1, TILE_W streams took
 * the L1 fill buffers and evicted the input rows. Up to STREAM_ROWS the tile takes all the rows in
 * one pass; from WIDE_ROWS on it takes them PASS_ROWS at a time in WIDE_W weight rows: fewer passes
 * over each tile, so fewer of a tile's FMAs wait for DRAM in its first pass while the later ones run
 * from L1. AVX-512's 32 registers hold 3 x 8 sums (AVX2's 16: 3 x 4, with 3 weight vectors and an
 * input vector). Item 38 measures both changes. */
#if ISA_AVX512F
#define TILE_W 4
#define WIDE_W 3
#define PASS_ROWS 8
#else
#define TILE_W 2
#define WIDE_W 3
#define PASS_ROWS 4
#endif
#define ONE_STREAM_ROWS 1
#define STREAM_ROWS 4
#define WIDE_ROWS 5
#define MAX_TILE_W (TILE_W > WIDE_W ? TILE_W : WIDE_W)
#define DEFINE_TILE_DOT(NAME, WT, LOADV, LOADS)                                                                  \
    static inline __attribute__((always_inline)) void NAME(const WT *const *w, const WT *const *wn, const float *x, \
                                                           int64_t ldx, int64_t k, const int NB, const int TW,   \
                                                           float (*d)[PASS_ROWS]) {                              \
        vf a[MAX_TILE_W][PASS_ROWS];                                                                             \
        for (int r = 0; r < TW; r++)                                                                             \
            for (int b = 0; b < NB; b++) a[r][b] = (vf){0};                                                      \
        int64_t i = 0;                                                                                           \
        for (; i + VL <= k; i += VL) {                                                                           \
            vf v[MAX_TILE_W];                                                                                    \
            if ((i * (int64_t)sizeof(WT)) % 64 == 0)                                                             \
                for (int r = 0; r < TW; r++) {                                                                   \
                    if (TW == 1) __builtin_prefetch(wn[r] + i, 0, 3); /* into L1 */                              \
                    else __builtin_prefetch(wn[r] + i, 0, 2);         /* into L2 */                              \
                }                                                                                                \
            for (int r = 0; r < TW; r++) v[r] = LOADV(w[r] + i);                                                 \
            for (int b = 0; b < NB; b++) {                                                                       \
                const vf xv = load_f32(x + b * ldx + i);                                                         \
                for (int r = 0; r < TW; r++) a[r][b] += v[r] * xv;                                               \
            }                                                                                                    \
        }                                                                                                        \
        for (int r = 0; r < TW; r++)                                                                             \
            for (int b = 0; b < NB; b++) {                                                                       \
                float s = hsum(a[r][b]);                                                                         \
                for (int64_t j = i; j < k; j++) s += LOADS(w[r][j]) * x[b * ldx + j];                            \
                d[r][b] = s;                                                                                     \
            }                                                                                                    \
    }

DEFINE_TILE_DOT(tile_dot_f32, float, load_f32, IDENTITY)
DEFINE_TILE_DOT(tile_dot_bf16, uint16_t, load_bf16, scalar_bf16)

/* The tile for tw (1, TILE_W or WIDE_W) and nb input rows, each shape a constant so that its sums
 * stay in registers (UPTO: a shape the build's PASS_ROWS has, for the cases it never takes). */
#define UPTO(c) ((c) < PASS_ROWS ? (c) : PASS_ROWS)
#define DEFINE_TILE_DISPATCH(NAME, DOT, WT)                                                                      \
    static void NAME(const WT *const *w, const WT *const *wn, const float *x, int64_t ldx, int64_t k, int nb,    \
                     int tw, float (*d)[PASS_ROWS]) {                                                            \
        if (tw == 1) { /* one input row */                                                                       \
            DOT(w, wn, x, ldx, k, 1, 1, d);                                                                      \
            return;                                                                                              \
        }                                                                                                        \
        if (tw == TILE_W && nb <= STREAM_ROWS) {                                                                 \
            switch (nb) {                                                                                        \
            case 1: DOT(w, wn, x, ldx, k, 1, TILE_W, d); return;                                                 \
            case 2: DOT(w, wn, x, ldx, k, 2, TILE_W, d); return;                                                 \
            case 3: DOT(w, wn, x, ldx, k, 3, TILE_W, d); return;                                                 \
            default: DOT(w, wn, x, ldx, k, 4, TILE_W, d); return;                                                \
            }                                                                                                    \
        }                                                                                                        \
        switch (nb) {                                                                                            \
        case 1: DOT(w, wn, x, ldx, k, 1, WIDE_W, d); return;                                                     \
        case 2: DOT(w, wn, x, ldx, k, 2, WIDE_W, d); return;                                                     \
        case 3: DOT(w, wn, x, ldx, k, 3, WIDE_W, d); return;                                                     \
        case 4: DOT(w, wn, x, ldx, k, 4, WIDE_W, d); return;                                                     \
        case 5: DOT(w, wn, x, ldx, k, UPTO(5), WIDE_W, d); return;                                               \
        case 6: DOT(w, wn, x, ldx, k, UPTO(6), WIDE_W, d); return;                                               \
        case 7: DOT(w, wn, x, ldx, k, UPTO(7), WIDE_W, d); return;                                               \
        default: DOT(w, wn, x, ldx, k, PASS_ROWS, WIDE_W, d); return;                                            \
        }                                                                                                        \
    }

DEFINE_TILE_DISPATCH(run_tile_f32, tile_dot_f32, float)
DEFINE_TILE_DISPATCH(run_tile_bf16, tile_dot_bf16, uint16_t)

/* ---- the weight-type table: one entry per format ---------------------------------------------- */
static inline const void *row_of(const Linear *m, int64_t r) { return (const char *)m->data + r * m->row_bytes; }

/* ---- dense fp32 / bf16 weights over many input rows (prefill, large decode batches) ------------
 * The tiles above take a dot product per (weight row, input row): every tile converts its bf16
 * weights again for each group of input rows, ends in horizontal sums, and reads its inputs from
 * L2 as often as its weights. From GEMM_MIN_ROWS rows the outputs are computed the other way round,
 * as outer products (the register blocking of BLAS kernels): the team transposes GEMM_X_ROWS input
 * rows at a time into shared panels of GEMM_NB rows ([k][GEMM_NB]); each thread takes groups of
 * GEMM_MR weight rows and, per chunk of GEMM_KC columns (bf16: widened into an L1 buffer once per
 * chunk for every panel of the block), broadcasts one weight scalar per row against each panel's
 * GEMM_NV vectors: GEMM_MR x GEMM_NV accumulators, no horizontal sums, partial sums kept per panel
 * across chunks. Each output is one lane's running sum over k (the tiles' sums run in VL lanes,
 * then add up): results agree to fp32 rounding. 256-row blocks halve the bf16 widening of 128-row
 * ones.
 * AVX-512: 8 x 2 zmm accumulators of 16 lanes; AVX2: 6 x 2 ymm (of 16 registers). More weight rows
 * spill their row pointers from the 16 general registers (12 rows: four stack loads per k). Below
 * GEMM_MIN_ROWS (one panel) the padded panel wastes more than the tiles lose. Measured against
 * oneDNN and MKL in docs/performance.md, "Weights held once". */
#if ISA_AVX512F
#define GL 16
#define GEMM_MR 8
#elif ISA_AVX2
#define GL 8
#define GEMM_MR 6
#else
#define GL 8
#define GEMM_MR 4
#endif
#define GEMM_NV 2
#define GEMM_NB (GEMM_NV * GL)
#define GEMM_MIN_ROWS GEMM_NB
#define GEMM_X_ROWS 256 /* a whole number of panels */
#define GEMM_KC 256
typedef float vg __attribute__((vector_size(4 * GL)));

/* out[r][j] (+)= sum_i w[r][i] xt[i][j] for GEMM_MR rows w (fp32, k each) and one panel xt (add: onto out). */
static inline void gemm_tile(const float *const *w, const float *xt, int64_t k, float (*out)[GEMM_NB], int add) {
    vg acc[GEMM_MR][GEMM_NV];
    for (int r = 0; r < GEMM_MR; r++)
        for (int v = 0; v < GEMM_NV; v++) {
            acc[r][v] = (vg){0};
            if (add) memcpy(&acc[r][v], &out[r][v * GL], sizeof(vg));
        }
    for (int64_t i = 0; i < k; i++) {
        vg xv[GEMM_NV];
        for (int v = 0; v < GEMM_NV; v++) xv[v] = *(const vg *)(xt + i * GEMM_NB + v * GL);
#pragma GCC unroll 8
        for (int r = 0; r < GEMM_MR; r++) {
            const float wi = w[r][i];
            for (int v = 0; v < GEMM_NV; v++) acc[r][v] += wi * xv[v];
        }
    }
    for (int r = 0; r < GEMM_MR; r++)
        for (int v = 0; v < GEMM_NV; v++) memcpy(&out[r][v * GL], &acc[r][v], sizeof(vg));
}

/* Input rows [0, rows) transposed into panels, xt[p][i][j] = x[p * GEMM_NB + j][i] (zero past rows),
 * shared by the team: each thread writes its share of the panels' columns. */
static void gemm_pack_inputs(const float *x, int64_t ldx, int64_t rows, int64_t k, float *xt) {
    const int64_t columns = (rows + GEMM_NB - 1) / GEMM_NB * GEMM_NB;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < columns; b++) {
        float *dst = xt + (b / GEMM_NB) * k * GEMM_NB + b % GEMM_NB;
        if (b < rows)
            for (int64_t i = 0; i < k; i++) dst[i * GEMM_NB] = x[b * ldx + i];
        else
            for (int64_t i = 0; i < k; i++) dst[i * GEMM_NB] = 0.0f;
    }
}

/* y [rows, n] (row stride ldy) = x W^T (+ m->bias) for a dense f32 / bf16 matrix (bf16: widened
 * into wbuf, GEMM_MR x GEMM_KC floats). Called by every thread of a team (or outside one):
 * work-shares the packing and its weight rows, and ends in a barrier like the tiles. */
static void gemm_rows(const Linear *m, int bf16, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy) {
    const int64_t n = m->n, k = m->k, groups = (n + GEMM_MR - 1) / GEMM_MR;
    /* one panel buffer for the team (panels are read as aligned vectors: GEMM_NB floats are a
     * whole number of them); the weight chunk buffer per thread */
    float *xt;
#pragma omp single copyprivate(xt)
    xt = aligned_alloc(sizeof(vg), sizeof(float) * (size_t)(k * GEMM_X_ROWS));
    float *wbuf = bf16 ? malloc(sizeof(float) * GEMM_MR * GEMM_KC) : NULL;
    const int ok = xt != NULL && (!bf16 || wbuf != NULL);
    /* NOTE: the worksharing loops end in barriers: a block's panels are whole before any thread
     * reads them, and read by all before the next block overwrites them */
    for (int64_t b0 = 0; b0 < rows; b0 += GEMM_X_ROWS) {
        const int64_t nb = rows - b0 < GEMM_X_ROWS ? rows - b0 : GEMM_X_ROWS;
        if (xt != NULL) gemm_pack_inputs(x + b0 * ldx, ldx, nb, k, xt);
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t r0 = g * GEMM_MR, mr = n - r0 < GEMM_MR ? n - r0 : GEMM_MR;
            if (!ok) { /* no scratch: plain dot products */
                for (int64_t r = r0; r < r0 + mr; r++) {
                    const float *wf = bf16 ? NULL : (const float *)row_of(m, r);
                    const uint16_t *wh = bf16 ? (const uint16_t *)row_of(m, r) : NULL;
                    for (int64_t b = 0; b < nb; b++) {
                        float s = m->bias != NULL ? m->bias[r] : 0.0f;
                        for (int64_t i = 0; i < k; i++) s += (bf16 ? scalar_bf16(wh[i]) : wf[i]) * x[(b0 + b) * ldx + i];
                        y[(b0 + b) * ldy + r] = s;
                    }
                }
                continue;
            }
            /* k in chunks of GEMM_KC: a bf16 chunk widened into wbuf stays in L1 for every panel */
            float out[GEMM_X_ROWS / GEMM_NB][GEMM_MR][GEMM_NB];
            const int64_t panels = (nb + GEMM_NB - 1) / GEMM_NB;
            for (int64_t kc = 0; kc < k; kc += GEMM_KC) {
                const int64_t kl = k - kc < GEMM_KC ? k - kc : GEMM_KC;
                const float *w[GEMM_MR];
                for (int r = 0; r < GEMM_MR; r++) {
                    const int64_t row = r0 + (r < mr ? r : mr - 1); /* a short last group repeats its last row */
                    if (!bf16) {
                        w[r] = (const float *)row_of(m, row) + kc;
                        continue;
                    }
                    float *dst = wbuf + r * GEMM_KC;
                    widen_bf16((const uint16_t *)row_of(m, row) + kc, kl, dst);
                    w[r] = dst;
                }
                for (int64_t p = 0; p < panels; p++) gemm_tile(w, xt + (p * k + kc) * GEMM_NB, kl, out[p], kc > 0);
            }
            for (int64_t p = 0; p < panels; p++) {
                const int64_t cols = nb - p * GEMM_NB < GEMM_NB ? nb - p * GEMM_NB : GEMM_NB;
                for (int64_t j = 0; j < cols; j++) {
                    float *yrow = y + (b0 + p * GEMM_NB + j) * ldy + r0;
                    for (int64_t r = 0; r < mr; r++) yrow[r] = out[p][r][j] + (m->bias != NULL ? m->bias[r0 + r] : 0.0f);
                }
            }
        }
    }
    free(wbuf);
#pragma omp single
    free(xt);
}

/* A format's LinearRows from its tile dot RUN_TILE (the last tile's missing rows repeat its last
 * row): the type is dispatched once per matrix, not per row (an indirect call per short row costs
 * a batch-1 step measurably). */
#define DEFINE_LINEAR_ROWS(NAME, RUN_TILE, WT, BF16)                                                             \
    void NAME(const Linear *m, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy) {        \
        if (rows >= GEMM_MIN_ROWS) {                                                                             \
            gemm_rows(m, BF16, x, ldx, rows, y, ldy);                                                            \
            return;                                                                                              \
        }                                                                                                        \
        const int64_t n = m->n, k = m->k;                                                                        \
        const int tw = rows <= ONE_STREAM_ROWS ? 1 : rows < WIDE_ROWS ? TILE_W : WIDE_W; /* the tile's width */  \
        _Pragma("omp for schedule(static) nowait") for (int64_t p = 0; p < (n + tw - 1) / tw; p++) {             \
            const WT *w[MAX_TILE_W], *wn[MAX_TILE_W];                                                            \
            int64_t r[MAX_TILE_W];                                                                               \
            for (int t = 0; t < tw; t++) {                                                                       \
                r[t] = p * tw + t < n ? p * tw + t : n - 1;                                                      \
                w[t] = (const WT *)row_of(m, r[t]);                                                              \
                wn[t] = (const WT *)row_of(m, r[t] + tw < n ? r[t] + tw : n - 1);                                \
            }                                                                                                    \
            for (int64_t b0 = 0; b0 < rows; b0 += PASS_ROWS) {                                                   \
                const int nb = rows - b0 < PASS_ROWS ? (int)(rows - b0) : PASS_ROWS;                             \
                float d[MAX_TILE_W][PASS_ROWS];                                                                  \
                RUN_TILE(w, wn, x + b0 * ldx, ldx, k, nb, tw, d);                                                \
                for (int t = 0; t < tw; t++)                                                                     \
                    for (int b = 0; b < nb; b++)                                                                 \
                        y[(b0 + b) * ldy + r[t]] = d[t][b] + (m->bias != NULL ? m->bias[r[t]] : 0.0f);           \
            }                                                                                                    \
        }                                                                                                        \
    }

DEFINE_LINEAR_ROWS(linear_rows_f32, run_tile_f32, float, 0)
DEFINE_LINEAR_ROWS(linear_rows_bf16, run_tile_bf16, uint16_t, 1)

void to_f32_f32(const Linear *m, int64_t r, float *out) {
    memcpy(out, row_of(m, r), sizeof(float) * (size_t)m->k);
}

void to_f32_bf16(const Linear *m, int64_t r, float *out) {
    widen_bf16((const uint16_t *)row_of(m, r), m->k, out);
}

/* Generated from WEIGHT_FORMATS (cpu_kernels.h): block sizes and bytes are ggml's. */
#define WEIGHT_TYPE_ROW(NAME, BLOCK_SIZE, BLOCK_BYTES, GROUP_ROWS) \
    {#NAME, BLOCK_SIZE, BLOCK_BYTES, GROUP_ROWS, linear_rows_##NAME, to_f32_##NAME},
const WeightType weight_types[] = {WEIGHT_FORMATS(WEIGHT_TYPE_ROW)};
#undef WEIGHT_TYPE_ROW
const int64_t num_weight_types = sizeof weight_types / sizeof weight_types[0];

/* The table's index of a format's name, or -1. */
int64_t weight_type_index(const char *name) {
    for (int64_t t = 0; t < num_weight_types; t++)
        if (strcmp(weight_types[t].name, name) == 0) return t;
    return -1;
}

/* Chains longer than this are refused (a stacked layer has at most three parts). */
#define MAX_CHAIN 8

int linear_is_valid(const Linear *m) {
    const int64_t k = m->k;
    for (int parts = 0; m != NULL; m = m->next, parts++) {
        if (parts == MAX_CHAIN || m->data == NULL || m->type < 0 || m->type >= num_weight_types || m->n <= 0 ||
            m->k <= 0 || m->k != k)
            return 0;
        const WeightType *t = &weight_types[m->type];
        /* the K-quants' input groups are their blocks; the others' are 32 (and 16 for the sums) */
        if (m->k % t->block_size != 0 || m->row_bytes != m->k / t->block_size * t->block_bytes ||
            (t->block_size > 1 && m->k % 32 != 0) || m->n % t->group_rows != 0 || !weight_type_ready(t->name))
            return 0;
    }
    return 1;
}

/* The outputs of m and every matrix chained after it. */
int64_t linear_outputs(const Linear *m) {
    int64_t n = 0;
    for (; m != NULL; m = m->next) n += m->n;
    return n;
}

/* ---- the ABI the ctypes side checks at load --------------------------------------------------- */
int64_t nanovllm_abi_version(void) { return NANOVLLM_ABI_VERSION; }

/* sizeof the named structure, or -1. */
int64_t nanovllm_struct_size(const char *name) {
    if (strcmp(name, "Linear") == 0) return (int64_t)sizeof(Linear);
    if (strcmp(name, "DecoderLayer") == 0) return (int64_t)sizeof(DecoderLayer);
    if (strcmp(name, "DecoderModel") == 0) return (int64_t)sizeof(DecoderModel);
    if (strcmp(name, "DecodeStep") == 0) return (int64_t)sizeof(DecodeStep);
    if (strcmp(name, "MoeExperts") == 0) return (int64_t)sizeof(MoeExperts);
    if (strcmp(name, "DeltaNetLayer") == 0) return (int64_t)sizeof(DeltaNetLayer);
    if (strcmp(name, "ShortConvLayer") == 0) return (int64_t)sizeof(ShortConvLayer);
    if (strcmp(name, "Mamba2Layer") == 0) return (int64_t)sizeof(Mamba2Layer);
    if (strcmp(name, "LoraMatrix") == 0) return (int64_t)sizeof(LoraMatrix);
    if (strcmp(name, "LoraStep") == 0) return (int64_t)sizeof(LoraStep);
    return -1;
}

/* Every field both sides lay out, with its offset in C: the ctypes side compares each of its
 * structures' fields with these (two fields of one size swapped keep the size, not the offsets). */
#define FIELD(S, F) {#S, #F, (int64_t)offsetof(S, F)}
static const struct { const char *structure, *field; int64_t offset; } fields[] = {
    FIELD(Linear, data), FIELD(Linear, bias), FIELD(Linear, scales), FIELD(Linear, n), FIELD(Linear, k),
    FIELD(Linear, type), FIELD(Linear, row_bytes), FIELD(Linear, next), FIELD(Linear, input_planes),
    FIELD(MoeExperts, gate_up), FIELD(MoeExperts, down), FIELD(MoeExperts, num_experts),
    FIELD(MoeExperts, top_k), FIELD(MoeExperts, renormalize), FIELD(MoeExperts, hidden),
    FIELD(MoeExperts, intermediate), FIELD(MoeExperts, router), FIELD(MoeExperts, shared_gate_up),
    FIELD(MoeExperts, shared_down), FIELD(MoeExperts, shared_gate), FIELD(MoeExperts, activation),
    FIELD(MoeExperts, alpha), FIELD(MoeExperts, limit),
    FIELD(MoeExperts, n_group), FIELD(MoeExperts, topk_group), FIELD(MoeExperts, correction_bias),
    FIELD(MoeExperts, routed_scale),
    FIELD(DeltaNetLayer, conv_w), FIELD(DeltaNetLayer, conv_state), FIELD(DeltaNetLayer, state),
    FIELD(DeltaNetLayer, A_log), FIELD(DeltaNetLayer, dt_bias), FIELD(DeltaNetLayer, norm),
    FIELD(DeltaNetLayer, nk), FIELD(DeltaNetLayer, nv), FIELD(DeltaNetLayer, dk), FIELD(DeltaNetLayer, dv),
    FIELD(DeltaNetLayer, K), FIELD(DeltaNetLayer, tiled),
    FIELD(ShortConvLayer, conv_w), FIELD(ShortConvLayer, conv_bias), FIELD(ShortConvLayer, conv_state),
    FIELD(ShortConvLayer, C), FIELD(ShortConvLayer, K),
    FIELD(Mamba2Layer, proj), FIELD(Mamba2Layer, out), FIELD(Mamba2Layer, conv_w), FIELD(Mamba2Layer, conv_b), FIELD(Mamba2Layer, conv_state), FIELD(Mamba2Layer, ssm),
    FIELD(Mamba2Layer, A_log), FIELD(Mamba2Layer, D), FIELD(Mamba2Layer, dt_bias), FIELD(Mamba2Layer, norm),
    FIELD(Mamba2Layer, heads), FIELD(Mamba2Layer, p), FIELD(Mamba2Layer, n), FIELD(Mamba2Layer, groups),
    FIELD(Mamba2Layer, heads_per_group), FIELD(Mamba2Layer, K), FIELD(Mamba2Layer, norm_width),
    FIELD(Mamba2Layer, norm_before_gate),
    FIELD(Mamba2Layer, dt_min), FIELD(Mamba2Layer, dt_max),
    FIELD(DecoderLayer, input_norm), FIELD(DecoderLayer, post_norm), FIELD(DecoderLayer, q_norm),
    FIELD(DecoderLayer, k_norm), FIELD(DecoderLayer, qkv), FIELD(DecoderLayer, o), FIELD(DecoderLayer, gate_up),
    FIELD(DecoderLayer, down), FIELD(DecoderLayer, k_cache), FIELD(DecoderLayer, v_cache),
    FIELD(DecoderLayer, in_c), FIELD(DecoderLayer, moe), FIELD(DecoderLayer, window),
    FIELD(DecoderLayer, sinks), FIELD(DecoderLayer, kv_group), FIELD(DecoderLayer, attn_gate),
    FIELD(DecoderLayer, linear), FIELD(DecoderLayer, no_rope), FIELD(DecoderLayer, short_conv),
    FIELD(DecoderLayer, mamba2),
    FIELD(DecoderModel, num_layers), FIELD(DecoderModel, hidden), FIELD(DecoderModel, num_heads),
    FIELD(DecoderModel, num_kv_heads), FIELD(DecoderModel, head_dim), FIELD(DecoderModel, intermediate),
    FIELD(DecoderModel, block_size), FIELD(DecoderModel, kv_type), FIELD(DecoderModel, eps),
    FIELD(DecoderModel, scale), FIELD(DecoderModel, rotary_dim), FIELD(DecoderModel, cos_sin),
    FIELD(DecoderModel, final_norm), FIELD(DecoderModel, layers), FIELD(DecoderModel, embed),
    FIELD(DecoderModel, head), FIELD(DecoderModel, embed_scale), FIELD(DecoderModel, residual_scale),
    FIELD(DecoderModel, logit_scale),
    FIELD(DecodeStep, positions), FIELD(DecodeStep, slots), FIELD(DecodeStep, block_tables),
    FIELD(DecodeStep, context_lens), FIELD(DecodeStep, num_seqs), FIELD(DecodeStep, max_blocks),
    FIELD(DecodeStep, max_context), FIELD(DecodeStep, store_first), FIELD(DecodeStep, state_slots),
    FIELD(LoraMatrix, a), FIELD(LoraMatrix, b), FIELD(LoraMatrix, k), FIELD(LoraMatrix, n), FIELD(LoraMatrix, rank),
    FIELD(LoraMatrix, parts), FIELD(LoraMatrix, slots), FIELD(LoraMatrix, part_ends), FIELD(LoraMatrix, dtype),
    FIELD(LoraMatrix, a_scale), FIELD(LoraMatrix, b_scale),
    FIELD(LoraStep, mats), FIELD(LoraStep, row_slots), FIELD(LoraStep, width),
};
#undef FIELD

/* offsetof the named structure's named field, or -1 where C has no such field. */
int64_t nanovllm_field_offset(const char *structure, const char *field) {
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
        if (strcmp(fields[i].structure, structure) == 0 && strcmp(fields[i].field, field) == 0) return fields[i].offset;
    return -1;
}

/* How many fields of the named structure the table above holds. */
int64_t nanovllm_field_count(const char *structure) {
    int64_t n = 0;
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) n += strcmp(fields[i].structure, structure) == 0;
    return n;
}

static int64_t kernel_failure_count;
void note_kernel_failure(void) { __atomic_add_fetch(&kernel_failure_count, 1, __ATOMIC_RELAXED); }
int64_t kernel_failures(void) { return __atomic_load_n(&kernel_failure_count, __ATOMIC_RELAXED); }

/* NOTE: m must be valid (linear_is_valid): the callers check every matrix once. */
void linear_rows_nowait(const Linear *m, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy) {
    for (; m != NULL; y += m->n, m = m->next) weight_types[m->type].linear_rows(m, x, ldx, rows, y, ldy);
}

/* The parts of a chain (q, k, v; gate, up) write disjoint outputs: one barrier after the last. */
void linear_rows_for(const Linear *m, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy) {
    linear_rows_nowait(m, x, ldx, rows, y, ldy);
#pragma omp barrier
}

/* y [rows, n] = x [rows, k] W^T (+ bias: this call's, not w's; over all outputs of a chain), all
 * contiguous, n the outputs of w's chain. Returns 1 (and computes nothing) when w is not a valid
 * matrix, 2 when a row loop could not allocate its scratch (y is then incomplete). */
int linear_f32(const Linear *w, const float *bias, const float *x, float *y, int64_t rows, int num_threads) {
    if (!linear_is_valid(w)) return 1;
    const int64_t failures = kernel_failures();
    Linear parts[MAX_CHAIN];
    int64_t count = 0, offset = 0;
    for (const Linear *p = w; p != NULL; p = p->next, count++) {
        parts[count] = *p;
        parts[count].bias = bias != NULL ? bias + offset : NULL;
        parts[count].next = NULL;
        if (count > 0) parts[count - 1].next = &parts[count];
        offset += p->n;
    }
#pragma omp parallel num_threads(num_threads)
    linear_rows_for(parts, x, w->k, rows, y, offset);
    return kernel_failures() != failures ? 2 : 0;
}

/* out [count, k] = rows ids of m as fp32 (embedding lookups). Returns 1 for an id outside [0, n)
 * or an invalid matrix (nothing is computed then). */
int linear_rows_to_f32(const Linear *m, const int64_t *ids, int64_t count, float *out, int num_threads) {
    if (!linear_is_valid(m) || m->next != NULL) return 1;
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= m->n) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < count; i++) weight_types[m->type].row_to_f32(m, ids[i], out + i * m->k);
    return 0;
}

/* ---- the machine's read floor (utils/efficiency.py, scripts/read_bandwidth.py) -------------------
 * Every byte of p[0, bytes) read once by the team, in the widest loads the build has (512-bit with
 * AVX-512, else 256-bit, else 64-bit) into independent accumulators; returns the xor of all its
 * 64-bit words (so nothing can be skipped, and a test can check it). bytes a multiple of 256. */
int64_t read_bytes(const void *p, int64_t bytes) {
    uint64_t out = 0;
    const int64_t chunks = bytes / 256;
#pragma omp parallel
    {
        uint64_t mine = 0;
#if ISA_AVX512F
        __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
#pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < chunks; i++) {
            const uint8_t *q = (const uint8_t *)p + i * 256;
            a = _mm512_xor_si512(a, _mm512_loadu_si512(q));
            b = _mm512_xor_si512(b, _mm512_loadu_si512(q + 64));
            c = _mm512_xor_si512(c, _mm512_loadu_si512(q + 128));
            d = _mm512_xor_si512(d, _mm512_loadu_si512(q + 192));
        }
        uint64_t lanes[8];
        _mm512_storeu_si512(lanes, _mm512_xor_si512(_mm512_xor_si512(a, b), _mm512_xor_si512(c, d)));
        for (int l = 0; l < 8; l++) mine ^= lanes[l];
#elif ISA_AVX2
        __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
#pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < chunks; i++) {
            const __m256i *q = (const __m256i *)((const uint8_t *)p + i * 256);
            a = _mm256_xor_si256(a, _mm256_xor_si256(_mm256_loadu_si256(q), _mm256_loadu_si256(q + 4)));
            b = _mm256_xor_si256(b, _mm256_xor_si256(_mm256_loadu_si256(q + 1), _mm256_loadu_si256(q + 5)));
            c = _mm256_xor_si256(c, _mm256_xor_si256(_mm256_loadu_si256(q + 2), _mm256_loadu_si256(q + 6)));
            d = _mm256_xor_si256(d, _mm256_xor_si256(_mm256_loadu_si256(q + 3), _mm256_loadu_si256(q + 7)));
        }
        uint64_t lanes[4];
        _mm256_storeu_si256((__m256i *)lanes, _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d)));
        for (int l = 0; l < 4; l++) mine ^= lanes[l];
#else
#pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < chunks; i++)
            for (int w = 0; w < 32; w++) {
                uint64_t v;
                memcpy(&v, (const uint8_t *)p + i * 256 + 8 * w, sizeof v);
                mine ^= v;
            }
#endif
#pragma omp atomic
        out ^= mine;
    }
    return (int64_t)out;
}
