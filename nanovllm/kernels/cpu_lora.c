/* LoRA adapters inside the C decode step (lora/layers.py holds the slots; executor/cpu_decode.py
 * points this at them): after a matrix's base product y = x W^T, each row b with an adapter slot
 * s = row_slots[b] gets y[b] += (x[b] A_s^T) B_s^T, the scale already folded into B. Two orphaned
 * worksharing loops, Punica's SGMV shape over the step's few rows: the shrink (one work item per
 * row and adapter rank row, t [B, parts * rank] shared) and the expand (output columns shared out,
 * each column reading its part's rank values of t). Rows without a slot cost nothing. */
#include "cpu_kernels.h"

static float dot_f32(const float *x, const float *w, int64_t n) {
    vf acc0 = {0}, acc1 = {0};
    int64_t i = 0;
    for (; i + 2 * VL <= n; i += 2 * VL) {
        acc0 += load_f32(x + i) * load_f32(w + i);
        acc1 += load_f32(x + i + VL) * load_f32(w + i + VL);
    }
    for (; i + VL <= n; i += VL) acc0 += load_f32(x + i) * load_f32(w + i);
    float s = hsum(acc0 + acc1);
    for (; i < n; i++) s += x[i] * w[i];
    return s;
}

int lora_matrix_is_valid(const LoraMatrix *W) {
    if (W->a == NULL || W->b == NULL || W->k <= 0 || W->n <= 0 || W->rank <= 0 || W->slots <= 0 ||
        W->parts <= 0 || W->parts > LORA_MAX_PARTS || W->part_ends[W->parts - 1] != W->n)
        return 0;
    for (int64_t p = 0; p < W->parts; p++)
        if (W->part_ends[p] <= (p > 0 ? W->part_ends[p - 1] : 0)) return 0;
    return 1;
}

void phase_lora(const LoraMatrix *W, const float *x, int64_t ldx, int64_t B, const int64_t *row_slots, float *t,
                float *y, int64_t ldy) {
    const int64_t R = W->rank, PR = W->parts * R, k = W->k, n = W->n;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < B * PR; item++) {
        const int64_t b = item / PR, r = item % PR, slot = row_slots[b];
        if (slot >= 0 && slot < W->slots) t[b * PR + r] = dot_f32(x + b * ldx, W->a + (slot * PR + r) * k, k);
    }
    /* the expand, output columns shared out in chunks of 32 (split where a part ends): each row's
     * columns accumulate its part's rank values of t times B's rows, 8 lanes at a time */
    const int64_t chunks = (n + 31) / 32;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t end = (c + 1) * 32 < n ? (c + 1) * 32 : n;
        int64_t j = c * 32, p = 0;
        while (j < end) {
            while (j >= W->part_ends[p]) p++;
            const int64_t stop = end < W->part_ends[p] ? end : W->part_ends[p];
            for (int64_t b = 0; b < B; b++) {
                const int64_t slot = row_slots[b];
                if (slot < 0 || slot >= W->slots) continue;
                const float *tb = t + b * PR + p * R, *bs = W->b + slot * R * n;
                float *yb = y + b * ldy;
                int64_t i = j;
                for (; i + VL <= stop; i += VL) {
                    vf acc = load_f32(yb + i);
                    for (int64_t r = 0; r < R; r++) acc += tb[r] * load_f32(bs + r * n + i);
                    store_f32(yb + i, acc);
                }
                for (; i < stop; i++)
                    for (int64_t r = 0; r < R; r++) yb[i] += tb[r] * bs[r * n + i];
            }
            j = stop;
        }
    }
}
