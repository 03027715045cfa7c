/* LoRA adapters inside the C decode step (lora/layers.py holds the slots; executor/cpu_decode.py
 * points this at them): after a matrix's base product y = x W^T, each row b with an adapter slot
 * s = row_slots[b] gets y[b] += (x[b] A_s^T) B_s^T, the scale already folded into B. Two orphaned
 * worksharing loops, Punica's SGMV shape over the step's few rows: the shrink (a work item per row
 * and four rank rows of A, t [B, parts * rank] shared) and the expand (a work item per row, or per
 * column range of a row when rows are fewer than threads, accumulating each part's rank values of t
 * times B^T's rows).
 * Rows without a slot cost nothing. A and B are fp32, bf16 or int8 with a scale per row (lora_dtype:
 * a half or a quarter of the bytes, which is what a step with many adapters pays for). */
#include <omp.h>

#include "cpu_kernels.h"
#include "cpu_kv_formats.h" /* i8x8 */

/* One 8-lane load of A or B, widened to fp32 (int8: before its row's scale). */
static inline vf load_ab(const void *p, int64_t i, int64_t dtype) {
    if (dtype == LORA_I8) return i8x8((const uint8_t *)p + i);
    return dtype == LORA_BF16 ? load_bf16((const uint16_t *)p + i) : load_f32((const float *)p + i);
}

static inline float scalar_ab(const void *p, int64_t i, int64_t dtype) {
    if (dtype == LORA_I8) return (float)((const int8_t *)p)[i];
    return dtype == LORA_BF16 ? scalar_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* x [n] . w [n] */
static float dot_ab(const float *x, const void *w, int64_t n, int64_t dtype) {
    vf acc0 = {0}, acc1 = {0};
    int64_t i = 0;
    for (; i + 2 * VL <= n; i += 2 * VL) {
        acc0 += load_f32(x + i) * load_ab(w, i, dtype);
        acc1 += load_f32(x + i + VL) * load_ab(w, i + VL, dtype);
    }
    for (; i + VL <= n; i += VL) acc0 += load_f32(x + i) * load_ab(w, i, dtype);
    float s = hsum(acc0 + acc1);
    for (; i < n; i++) s += x[i] * scalar_ab(w, i, dtype);
    return s;
}

int lora_matrix_is_valid(const LoraMatrix *W) {
    if (W->a == NULL || W->b == NULL || W->k <= 0 || W->n <= 0 || W->rank <= 0 || W->slots <= 0 ||
        W->parts <= 0 || W->parts > LORA_MAX_PARTS || W->part_ends[W->parts - 1] != W->n ||
        (W->dtype != LORA_F32 && W->dtype != LORA_BF16 && W->dtype != LORA_I8) ||
        (W->dtype == LORA_I8 && (W->a_scale == NULL || W->b_scale == NULL)))
        return 0;
    for (int64_t p = 0; p < W->parts; p++)
        if (W->part_ends[p] <= (p > 0 ? W->part_ends[p - 1] : 0)) return 0;
    return 1;
}

void phase_lora(const LoraMatrix *W, const float *x, int64_t ldx, int64_t B, const int64_t *row_slots, float *t,
                float *y, int64_t ldy) {
    const int64_t R = W->rank, PR = W->parts * R, k = W->k, n = W->n;
    const int64_t dtype = W->dtype;
    const size_t size = dtype == LORA_I8 ? 1 : dtype == LORA_BF16 ? 2 : 4;
    const char *a = W->a, *bt = W->b;
    const int scaled = dtype == LORA_I8;
    const float *a_scale = scaled ? W->a_scale : NULL, *b_scale = scaled ? W->b_scale : NULL;
    /* the shrink: a work item per row and group of four rank rows of A (x's row loaded once for
     * the four; a last group of fewer where parts x rank is not a multiple of four) */
    const int64_t groups = (PR + 3) / 4;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < B * groups; item++) {
        const int64_t b = item / groups, r0 = item % groups * 4, slot = row_slots[b];
        if (slot < 0 || slot >= W->slots) continue;
        const float *xb = x + b * ldx;
        if (r0 + 4 <= PR) {
            const char *a0 = a + (size_t)((slot * PR + r0) * k) * size, *a1 = a0 + (size_t)k * size;
            const char *a2 = a1 + (size_t)k * size, *a3 = a2 + (size_t)k * size;
            vf s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
            int64_t i = 0;
            for (; i + VL <= k; i += VL) {
                const vf xv = load_f32(xb + i);
                s0 += xv * load_ab(a0, i, dtype);
                s1 += xv * load_ab(a1, i, dtype);
                s2 += xv * load_ab(a2, i, dtype);
                s3 += xv * load_ab(a3, i, dtype);
            }
            float d[4] = {hsum(s0), hsum(s1), hsum(s2), hsum(s3)};
            for (; i < k; i++) {
                d[0] += xb[i] * scalar_ab(a0, i, dtype);
                d[1] += xb[i] * scalar_ab(a1, i, dtype);
                d[2] += xb[i] * scalar_ab(a2, i, dtype);
                d[3] += xb[i] * scalar_ab(a3, i, dtype);
            }
            for (int q = 0; q < 4; q++) t[b * PR + r0 + q] = a_scale != NULL ? d[q] * a_scale[slot * PR + r0 + q] : d[q];
        } else {
            for (int64_t r = r0; r < PR; r++) {
                const float dot = dot_ab(xb, a + (size_t)((slot * PR + r) * k) * size, k, dtype);
                t[b * PR + r] = a_scale != NULL ? dot * a_scale[slot * PR + r] : dot;
            }
        }
    }
    /* the expand: work items of one row's column range (at 8-lane bounds): whole rows when the step
     * has a row per thread, else each row's columns split so that every thread has a range. Per
     * item, each rank row r of its slot's B^T streams along the range, part after part (a part's
     * scale changes where it ends), y's range staying in L1 across the rank rows: over whole rows
     * B^T is read as one sequential stream. (One range per thread across all rows left each row's
     * B^T in short chunks, a DRAM latency each: 2.6 ms a step of 8 int8 adapters, 30 layers.) */
    const int64_t threads = omp_get_num_threads();
    const int64_t chunks = B >= threads ? 1 : (threads + B - 1) / B, lanes = (n + VL - 1) / VL;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < B * chunks; item++) {
        const int64_t b = item / chunks, c = item % chunks, slot = row_slots[b];
        if (slot < 0 || slot >= W->slots) continue;
        const int64_t first = lanes * c / chunks * VL, last = lanes * (c + 1) / chunks * VL;
        const int64_t end = last < n ? last : n;
        if (first >= end) continue;
        int64_t p0 = 0;
        while (first >= W->part_ends[p0]) p0++;
        const float *tb = t + b * PR;
        const char *bs = bt + (size_t)(slot * R * n) * size;
        float *yb = y + b * ldy;
        /* four rank rows a pass where the rank allows (y's range loaded and stored once for four
         * rows of B^T), then one at a time */
        int64_t r = 0;
        for (; r + 4 <= R; r += 4) {
            for (int64_t j = first, p = p0; j < end; p++) {
                const int64_t stop = end < W->part_ends[p] ? end : W->part_ends[p];
                float c[4];
                for (int q = 0; q < 4; q++)
                    c[q] = b_scale != NULL ? tb[p * R + r + q] * b_scale[(slot * R + r + q) * W->parts + p] : tb[p * R + r + q];
                const char *b0 = bs + (size_t)(r * n) * size, *b1 = b0 + (size_t)n * size;
                const char *b2 = b1 + (size_t)n * size, *b3 = b2 + (size_t)n * size;
                int64_t i = j;
                for (; i + VL <= stop; i += VL)
                    store_f32(yb + i, load_f32(yb + i) + c[0] * load_ab(b0, i, dtype) + c[1] * load_ab(b1, i, dtype) +
                                          c[2] * load_ab(b2, i, dtype) + c[3] * load_ab(b3, i, dtype));
                for (; i < stop; i++)
                    yb[i] += c[0] * scalar_ab(b0, i, dtype) + c[1] * scalar_ab(b1, i, dtype) +
                             c[2] * scalar_ab(b2, i, dtype) + c[3] * scalar_ab(b3, i, dtype);
                j = stop;
            }
        }
        for (; r < R; r++) {
            for (int64_t j = first, p = p0; j < end; p++) {
                const int64_t stop = end < W->part_ends[p] ? end : W->part_ends[p];
                const float tr = b_scale != NULL ? tb[p * R + r] * b_scale[(slot * R + r) * W->parts + p] : tb[p * R + r];
                int64_t i = j;
                for (; i + VL <= stop; i += VL) store_f32(yb + i, load_f32(yb + i) + tr * load_ab(bs, r * n + i, dtype));
                for (; i < stop; i++) yb[i] += tr * scalar_ab(bs, r * n + i, dtype);
                j = stop;
            }
        }
    }
}

int lora_apply(const LoraMatrix *W, const float *x, int64_t ldx, int64_t B, const int64_t *row_slots, float *t,
               float *y, int64_t ldy, int num_threads) {
    if (!lora_matrix_is_valid(W)) return -1;
#pragma omp parallel num_threads(num_threads)
    phase_lora(W, x, ldx, B, row_slots, t, y, ldy);
    return 0;
}
