/* Shared declarations of the CPU kernels (cpu_kernels.c: attention and linear layers;
 * cpu_decode.c: the whole decode step). All activations are fp32; weights fp32 or bf16. */
#ifndef NANOVLLM_CPU_KERNELS_H
#define NANOVLLM_CPU_KERNELS_H

#include <stdint.h>

/* Element type of a weight matrix. bf16 weights are widened to fp32 as they are loaded, so the
 * products are the ones an fp32 matmul over the upcast weights computes. */
enum { WEIGHT_F32 = 0, WEIGHT_BF16 = 1 };

/* A linear layer: y = x W^T (+ bias), W [n, k] row-major and dense. */
typedef struct {
    const void *weight;
    const float *bias; /* [n] or NULL */
    int64_t n, k;
    int64_t weight_type; /* WEIGHT_F32 or WEIGHT_BF16 */
} Linear;

/* y[r, :] = W x[r, :] (+ bias) for rows r < rows (x row stride ldx, y row stride ldy).
 * An orphaned `omp for` over W's rows: inside a parallel region the threads share the work;
 * outside one it runs on the calling thread. */
void linear_rows_for(const Linear *m, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy);

/* Decode attention of one work item: the query heads of KV heads [kv_first, kv_end) of one
 * sequence, whose q and out are [num_heads, head_dim] and whose first `len` tokens sit in the
 * paged caches [num_blocks, block_size, num_kv_heads, head_dim] through `table`. scores needs
 * (kv_end - kv_first) * group * len floats, inv_sum (kv_end - kv_first) * group. */
void attend_item(const float *q, const float *k_cache, const float *v_cache, const int32_t *table, int64_t len,
                 float *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                 int64_t kv_first, int64_t kv_end, float scale, float *scores, int64_t scores_stride,
                 float *inv_sum);

#endif
