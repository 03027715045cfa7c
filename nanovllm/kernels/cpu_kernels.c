/* CPU kernels in C, fp32: paged decode attention, and the one-row matrix-vector product.
 *
 * paged_decode_attention_f32: decode attention over the paged KV cache, one query token per sequence.
 *
 * The torch path gathers every sequence's blocks into a padded copy and then runs SDPA over the
 * copy; this kernel reads each cached K and V row once, in place, through the block table.
 * Work items are sequences (or, for small batches, a sequence's KV heads split in kv_heads_per_item
 * chunks), spread over OpenMP threads. Within an item, tokens go outermost: a cached token's row
 * for all of the item's KV heads is contiguous, while one head's rows sit a page apart (reading
 * head by head was 2-3x slower), and the query heads sharing a KV head (GQA) use each row once.
 *
 * Layouts (row-major, contiguous):
 *   q            [num_seqs, num_heads, head_dim]
 *   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables [num_seqs, max_blocks] (int32; entries past a sequence's length are not read)
 *   context_lens [num_seqs] (int32, each <= max_context)
 *   out          [num_seqs, num_heads, head_dim]
 * Returns 0, or 1 when a thread could not allocate its score buffer (out is then incomplete).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

int paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, const int32_t *context_lens, float *out,
                               int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, int64_t max_blocks,
                               int64_t max_context, float scale, int64_t kv_heads_per_item,
                               int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim; /* floats between consecutive cached tokens */
    const int64_t items_per_seq = (num_kv_heads + kv_heads_per_item - 1) / kv_heads_per_item;
    const int64_t heads_per_item = kv_heads_per_item * group;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(heads_per_item * max_context));
        float *inv_sum = malloc(sizeof(float) * (size_t)heads_per_item);
        if (scores == NULL || inv_sum == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * items_per_seq; item++) {
            if (scores == NULL || inv_sum == NULL) continue;
            const int64_t s = item / items_per_seq;
            const int64_t kv_first = (item % items_per_seq) * kv_heads_per_item;
            const int64_t kv_end = kv_first + kv_heads_per_item < num_kv_heads ? kv_first + kv_heads_per_item
                                                                               : num_kv_heads;
            const int64_t num_item_heads = (kv_end - kv_first) * group;
            const int64_t len = context_lens[s];
            const int32_t *table = block_tables + s * max_blocks;
            /* This item's query heads are consecutive: kv_first * group .. kv_end * group. */
            const float *q_item = q + (s * num_heads + kv_first * group) * head_dim;
            float *out_item = out + (s * num_heads + kv_first * group) * head_dim;

            /* Pass 1: scaled scores q . k for every cached token and every head of the item. Tokens
             * go outermost so each token's K row (all of the item's KV heads) is read contiguously. */
            for (int64_t t = 0; t < len; t++) {
                const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
                const float *k_row = k_cache + slot * token_stride;
                for (int64_t h = 0; h < num_item_heads; h++) {
                    const float *k = k_row + (kv_first + h / group) * head_dim;
                    const float *qh = q_item + h * head_dim;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < head_dim; d++) dot += qh[d] * k[d];
                    scores[h * max_context + t] = dot * scale;
                }
            }
            /* Softmax numerators per head (max subtracted); the division comes at the end. */
            for (int64_t h = 0; h < num_item_heads; h++) {
                float *row = scores + h * max_context;
                float m = -INFINITY;
                for (int64_t t = 0; t < len; t++) m = row[t] > m ? row[t] : m;
                float sum = 0.0f;
                for (int64_t t = 0; t < len; t++) {
                    row[t] = expf(row[t] - m);
                    sum += row[t];
                }
                inv_sum[h] = 1.0f / sum;
                float *o = out_item + h * head_dim;
                for (int64_t d = 0; d < head_dim; d++) o[d] = 0.0f;
            }
            /* Pass 2: out = sum_t p_t v_t, each V row read once for all of the item's heads. */
            for (int64_t t = 0; t < len; t++) {
                const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
                const float *v_row = v_cache + slot * token_stride;
                for (int64_t h = 0; h < num_item_heads; h++) {
                    const float *v = v_row + (kv_first + h / group) * head_dim;
                    const float p = scores[h * max_context + t];
                    float *o = out_item + h * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) o[d] += p * v[d];
                }
            }
            for (int64_t h = 0; h < num_item_heads; h++) {
                float *o = out_item + h * head_dim;
                for (int64_t d = 0; d < head_dim; d++) o[d] *= inv_sum[h];
            }
        }
        free(scores);
        free(inv_sum);
    }
    return failed;
}

/* y = W x (+ bias) for one row x: W [n, k] row-major, dense. Four weight rows per step share each
 * load of x; rows are split statically over the threads, so each streams its own contiguous part
 * of W (oneDNN's packed one-row path read the weights 10-30% slower, docs/performance.md). */
void gemv_f32(const float *w, const float *x, const float *bias, float *y, int64_t n, int64_t k,
              int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < n; r += 4) {
        if (r + 4 <= n) {
            const float *w0 = w + r * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
            for (int64_t i = 0; i < k; i++) {
                const float xi = x[i];
                a0 += w0[i] * xi;
                a1 += w1[i] * xi;
                a2 += w2[i] * xi;
                a3 += w3[i] * xi;
            }
            y[r] = a0;
            y[r + 1] = a1;
            y[r + 2] = a2;
            y[r + 3] = a3;
        } else {
            for (int64_t j = r; j < n; j++) {
                const float *wj = w + j * k;
                float a = 0.0f;
#pragma omp simd reduction(+ : a)
                for (int64_t i = 0; i < k; i++) a += wj[i] * x[i];
                y[j] = a;
            }
        }
        if (bias != NULL) {
            for (int64_t j = r; j < r + 4 && j < n; j++) y[j] += bias[j];
        }
    }
}
