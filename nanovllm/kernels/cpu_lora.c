/* LoRA adapters inside the C decode step (lora/layers.py holds the slots; executor/cpu_decode.py
 * points this at them): after a matrix's base product y = x W^T, each row b with an adapter slot
 * s = row_slots[b] gets y[b] += (x[b] A_s^T) B_s^T, the scale already folded into B. Two orphaned
 * worksharing loops, Punica's SGMV shape over the step's few rows: the shrink (one work item per
 * row and adapter rank row, t [B, parts * rank] shared) and the expand (output columns shared out,
 * each row's columns accumulating its part's rank values of t times B^T's rows).
 * Rows without a slot cost nothing. A and B are fp32 or bf16 (lora_dtype: half the bytes, which is
 * what a step with many adapters pays for). */
#include <omp.h>

#include "cpu_kernels.h"

/* One 8-lane load of A or B, widened to fp32. */
static inline vf load_ab(const void *p, int64_t i, int bf16) {
    return bf16 ? load_bf16((const uint16_t *)p + i) : load_f32((const float *)p + i);
}

static inline float scalar_ab(const void *p, int64_t i, int bf16) {
    return bf16 ? scalar_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* x [n] . w [n], w fp32 or bf16 */
static float dot_ab(const float *x, const void *w, int64_t n, int bf16) {
    vf acc0 = {0}, acc1 = {0};
    int64_t i = 0;
    for (; i + 2 * VL <= n; i += 2 * VL) {
        acc0 += load_f32(x + i) * load_ab(w, i, bf16);
        acc1 += load_f32(x + i + VL) * load_ab(w, i + VL, bf16);
    }
    for (; i + VL <= n; i += VL) acc0 += load_f32(x + i) * load_ab(w, i, bf16);
    float s = hsum(acc0 + acc1);
    for (; i < n; i++) s += x[i] * scalar_ab(w, i, bf16);
    return s;
}

int lora_matrix_is_valid(const LoraMatrix *W) {
    if (W->a == NULL || W->b == NULL || W->k <= 0 || W->n <= 0 || W->rank <= 0 || W->slots <= 0 ||
        W->parts <= 0 || W->parts > LORA_MAX_PARTS || W->part_ends[W->parts - 1] != W->n ||
        (W->dtype != LORA_F32 && W->dtype != LORA_BF16))
        return 0;
    for (int64_t p = 0; p < W->parts; p++)
        if (W->part_ends[p] <= (p > 0 ? W->part_ends[p - 1] : 0)) return 0;
    return 1;
}

void phase_lora(const LoraMatrix *W, const float *x, int64_t ldx, int64_t B, const int64_t *row_slots, float *t,
                float *y, int64_t ldy) {
    const int64_t R = W->rank, PR = W->parts * R, k = W->k, n = W->n;
    const int bf16 = W->dtype == LORA_BF16;
    const size_t size = bf16 ? 2 : 4;
    const char *a = W->a, *bt = W->b;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < B * PR; item++) {
        const int64_t b = item / PR, r = item % PR, slot = row_slots[b];
        if (slot >= 0 && slot < W->slots) t[b * PR + r] = dot_ab(x + b * ldx, a + (size_t)((slot * PR + r) * k) * size, k, bf16);
    }
    /* the expand: the output columns split in one contiguous range per thread (at 8-lane bounds),
     * each range cut where a part ends. Per row, each rank row r of its B^T streams along the range
     * (y's range stays in L1 across the rank rows): one sequential read per row of B^T, where short
     * chunks of all R rows at once left the hardware prefetchers behind (2x slower at 8 slots). */
    const int64_t ranges = omp_get_num_threads();
#pragma omp for schedule(static)
    for (int64_t c = 0; c < ranges; c++) {
        const int64_t lanes = (n + VL - 1) / VL;
        const int64_t first = lanes * c / ranges * VL, last = lanes * (c + 1) / ranges * VL;
        int64_t j = first, p = 0;
        const int64_t end = last < n ? last : n;
        while (j < end) {
            while (j >= W->part_ends[p]) p++;
            const int64_t stop = end < W->part_ends[p] ? end : W->part_ends[p];
            for (int64_t b = 0; b < B; b++) {
                const int64_t slot = row_slots[b];
                if (slot < 0 || slot >= W->slots) continue;
                const float *tb = t + b * PR + p * R;
                const char *bs = bt + (size_t)(slot * R * n) * size;
                float *yb = y + b * ldy;
                for (int64_t r = 0; r < R; r++) {
                    const float tr = tb[r];
                    int64_t i = j;
                    for (; i + VL <= stop; i += VL) store_f32(yb + i, load_f32(yb + i) + tr * load_ab(bs, r * n + i, bf16));
                    for (; i < stop; i++) yb[i] += tr * scalar_ab(bs, r * n + i, bf16);
                }
            }
            j = stop;
        }
    }
}
