/* The whole decode step of a Llama-family decoder (Llama, Qwen2, Qwen3) in one call: the
 * embedding lookup; for every layer, residual add + RMSNorm, the qkv projection, q/k RMSNorm
 * (Qwen3), rotary embedding, the KV-cache store, paged attention, the output projection, residual
 * add + RMSNorm, the gated MLP; then the final norm and the LM head. One token per sequence.
 *
 * The eager forward runs ~140 small torch ops per layer, whose dispatch costs more than the
 * weight traffic at one or a few sequences; here one OpenMP parallel region covers the step: the
 * matmuls and the attention (each work item rotating and storing its own heads first) are
 * worksharing loops, whose ends are the only synchronisation, and every thread computes the norms
 * and SiLU of the few rows itself. Same math as the torch path, fp32 activations; weights fp32 or
 * bf16 (widened as they are read).
 *
 * Larger batches keep their matmuls on oneDNN, which uses the cores better there, and call the
 * phases between them one at a time (decode_add_rms_norm, decode_attention_layer,
 * decode_silu_mul): four C calls per layer instead of ~130 torch ops. Prefill steps do the same with
 * rope_store_layer in place of decode_attention_layer (their attention stays torch's SDPA).*/
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    const float *q_norm, *k_norm;        /* [head_dim] each, or NULL (no q/k norm) */
    Linear qkv, o, gate_up, down;        /* qkv: q, k, v rows stacked; gate_up: gate then up rows */
    float *k_cache, *v_cache;            /* [num_blocks, block_size, num_kv_heads, head_dim] */
} DecoderLayer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    const float *cos_sin;    /* [max_position, head_dim]: cos of the head_dim / 2 frequencies, then sin */
    const float *final_norm; /* [hidden] */
    const DecoderLayer *layers;
    const void *embed;       /* [vocab, hidden], fp32 or bf16 (embed_type, a WEIGHT_ value) */
    int64_t embed_type;
    Linear head;             /* the LM head: [vocab, hidden] (the embedding table itself when tied) */
} DecoderModel;

/* resid (+)= x; y = weight * (resid / rms(resid)), one row of n. */
static void add_rms_norm_row(const float *x, float *resid, int first, const float *weight, float eps, int64_t n,
                             float *y) {
    float sq = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float r = first ? x[i] : resid[i] + x[i];
        resid[i] = r;
        sq += r * r;
    }
    const float inv = 1.0f / sqrtf(sq / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = weight[i] * (resid[i] * inv);
}

/* In place: optional RMSNorm over the head (q/k norm), then neox-style rotation by cos/sin. */
static void norm_rope_head(float *x, const float *norm, float eps, const float *cos_sin, int64_t head_dim) {
    if (norm != NULL) {
        float sq = 0.0f;
        for (int64_t d = 0; d < head_dim; d++) sq += x[d] * x[d];
        const float inv = 1.0f / sqrtf(sq / (float)head_dim + eps);
        for (int64_t d = 0; d < head_dim; d++) x[d] = norm[d] * (x[d] * inv);
    }
    const int64_t half = head_dim / 2;
    const float *cos = cos_sin, *sin = cos_sin + half;
    for (int64_t d = 0; d < half; d++) {
        const float x1 = x[d], x2 = x[d + half];
        x[d] = x1 * cos[d] - x2 * sin[d];
        x[d + half] = x2 * cos[d] + x1 * sin[d];
    }
}

/* x [H] = the embedding row of token id (a bf16 row widened). */
static void embed_row(const DecoderModel *m, int64_t id, float *x) {
    const int64_t H = m->hidden;
    if (m->embed_type == WEIGHT_BF16) {
        const uint16_t *row = (const uint16_t *)m->embed + id * H;
        for (int64_t i = 0; i < H; i++) x[i] = scalar_bf16(row[i]);
    } else {
        memcpy(x, (const float *)m->embed + id * H, sizeof(float) * (size_t)H);
    }
}

/* ---- the phases of a layer: orphaned worksharing loops, run inside a parallel region ---------- */

/* Rows b < B: resid (+)= x; y = norm(resid). */
static void phase_add_norm(const float *x, float *resid, int first, const float *weight, float eps, int64_t B,
                           int64_t H, float *y) {
#pragma omp for
    for (int64_t b = 0; b < B; b++) add_rms_norm_row(x + b * H, resid + b * H, first, weight, eps, H, y + b * H);
}

/* Token b's query heads of KV heads [kv_first, kv_end) and those KV heads, in qkv [B, q | k | v]:
 * norm + rotary in place; each k head is stored with its v head in the token's cache slot (slot
 * < 0: not stored). */
static void rope_store_heads(const DecoderModel *m, const DecoderLayer *L, float *qkv, const int64_t *positions,
                             const int64_t *slots, int64_t b, int64_t kv_first, int64_t kv_end) {
    const int64_t D = m->head_dim, NH = m->num_heads, NKV = m->num_kv_heads, group = NH / NKV;
    const int64_t Q = NH * D, KV = NKV * D;
    float *row = qkv + b * (Q + 2 * KV);
    const float *cs = m->cos_sin + positions[b] * D;
    for (int64_t h = kv_first * group; h < kv_end * group; h++) norm_rope_head(row + h * D, L->q_norm, m->eps, cs, D);
    for (int64_t kh = kv_first; kh < kv_end; kh++) {
        float *k = row + Q + kh * D;
        norm_rope_head(k, L->k_norm, m->eps, cs, D);
        if (slots[b] >= 0) {
            memcpy(L->k_cache + (slots[b] * NKV + kh) * D, k, sizeof(float) * (size_t)D);
            memcpy(L->v_cache + (slots[b] * NKV + kh) * D, row + Q + KV + kh * D, sizeof(float) * (size_t)D);
        }
    }
}

/* Every token's q/k heads (rope_store_heads), one (token, KV head) per work item: prefill steps. */
static void phase_rope_store(const DecoderModel *m, const DecoderLayer *L, float *qkv, const int64_t *positions,
                             const int64_t *slots, int64_t B) {
    const int64_t NKV = m->num_kv_heads;
#pragma omp for
    for (int64_t item = 0; item < B * NKV; item++)
        rope_store_heads(m, L, qkv, positions, slots, item / NKV, item % NKV, item % NKV + 1);
}

/* KV heads per attention work item: whole sequences when there are enough of them to keep every
 * thread busy; else each sequence's KV heads split so that about 4 items per thread exist (one KV
 * head per item at 32 sequences ran 3x slower: a cached token's K row is read in pieces). */
static int64_t kv_heads_per_item(int64_t B, int64_t num_kv_heads, int num_threads) {
    int64_t splits = (4 * (int64_t)num_threads + B - 1) / B;
    splits = splits < num_kv_heads ? splits : num_kv_heads;
    return (num_kv_heads + splits - 1) / splits;
}

/* attn [B, num_heads * head_dim] = paged attention of each row's q over its cached tokens, each
 * work item first rotating its own q/k heads and storing its new K/V rows (rope_store_heads: the
 * item's heads are the only ones it reads, so no barrier is needed between the two).
 * scores: per_item * num_heads / num_kv_heads * max_context floats per thread. */
static void phase_rope_attention(const DecoderModel *m, const DecoderLayer *L, float *qkv, const int64_t *positions,
                                 const int64_t *slots, const int32_t *block_tables, const int32_t *context_lens,
                                 int64_t B, int64_t max_blocks, int64_t max_context, int64_t per_item, float *attn,
                                 float *scores, float *inv_sum) {
    const int64_t D = m->head_dim, NH = m->num_heads, NKV = m->num_kv_heads;
    const int64_t Q = NH * D, QKV = Q + 2 * NKV * D, items_per_seq = (NKV + per_item - 1) / per_item;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < B * items_per_seq; item++) {
        if (scores == NULL || inv_sum == NULL) continue;
        const int64_t b = item / items_per_seq, kv_first = (item % items_per_seq) * per_item;
        const int64_t kv_end = kv_first + per_item < NKV ? kv_first + per_item : NKV;
        rope_store_heads(m, L, qkv, positions, slots, b, kv_first, kv_end);
        attend_item(qkv + b * QKV, L->k_cache, L->v_cache, block_tables + b * max_blocks, context_lens[b],
                    attn + b * Q, NH, NKV, D, m->block_size, kv_first, kv_end, m->scale, scores, max_context,
                    inv_sum);
    }
}

/* act[i] = silu(g[i]) * u[i] for i in [first, end), VL lanes at a time (vexp: glibc's scalar expf
 * made SiLU a tenth of the step at 64 sequences). */
static void silu_mul_span(const float *g, const float *u, int64_t first, int64_t end, float *act) {
    int64_t i = first;
    for (; i + VL <= end; i += VL) {
        const vf gv = load_f32(g + i);
        store_f32(act + i, gv / (1.0f + vexp(-gv)) * load_f32(u + i));
    }
    for (; i < end; i++) act[i] = g[i] / (1.0f + sexp(-g[i])) * u[i];
}

/* act [B, I] = silu(gate) * up of gu [B, gate | up], shared out in 8-lane chunks. */
static void phase_silu_mul(const float *gu, int64_t B, int64_t I, float *act) {
    const int64_t chunks = (I + VL - 1) / VL;
#pragma omp for schedule(static)
    for (int64_t j = 0; j < B * chunks; j++) {
        const int64_t b = j / chunks, i = (j % chunks) * VL;
        silu_mul_span(gu + b * 2 * I, gu + b * 2 * I + I, i, i + VL < I ? i + VL : I, act + b * I);
    }
}

/* Per-thread attention buffers; NULL (and *failed set) when they cannot be allocated. */
static float *alloc_or_flag(size_t floats, int *failed) {
    float *p = malloc(sizeof(float) * (floats > 0 ? floats : 1));
    if (p == NULL) {
#pragma omp atomic write
        *failed = 1;
    }
    return p;
}

/* ---- the whole step ------------------------------------------------------------------------------
 * ids [num_seqs] -> logits [num_seqs, vocab]: embedding, every layer, the final norm and the LM
 * head; positions, slots (cache slot of each new token; < 0: not stored), block_tables
 * [num_seqs, max_blocks] and context_lens (the new token included, each <= max_context) as the
 * torch decode path gets them. Returns 0; 1 when a buffer could not be allocated, 2 for a token id
 * outside the vocabulary (logits are then incomplete). */
int decode_forward(const DecoderModel *m, const int64_t *ids, const int64_t *positions, const int64_t *slots,
                   const int32_t *block_tables, const int32_t *context_lens, int64_t num_seqs, int64_t max_blocks,
                   int64_t max_context, float *logits, int num_threads) {
    const int64_t H = m->hidden, NH = m->num_heads, NKV = m->num_kv_heads, D = m->head_dim;
    const int64_t I = m->intermediate, Q = NH * D, QKV = Q + 2 * NKV * D, B = num_seqs;
    for (int64_t b = 0; b < B; b++)
        if (ids[b] < 0 || ids[b] >= m->head.n) return 2;
    /* The activations every thread writes a share of: projection outputs, qkv, attention output,
     * gate|up. */
    float *buf = malloc(sizeof(float) * (size_t)B * (size_t)(H + QKV + Q + 2 * I));
    if (buf == NULL) return 1;
    float *proj = buf, *qkv = proj + B * H, *attn = qkv + B * QKV, *gu = attn + B * Q;
    const int64_t per_item = kv_heads_per_item(B, NKV, num_threads), heads = per_item * (NH / NKV);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = alloc_or_flag((size_t)(heads * max_context), &failed);
        float *inv_sum = alloc_or_flag((size_t)heads, &failed);
        /* Each thread's own residual stream, normed input and SiLU output: the norms and SiLU
         * (a few thousand floats at 1-2 rows) are computed by every thread alike, so the matmul
         * after them needs no barrier of its own (5 per layer instead of 9). */
        float *mine = alloc_or_flag((size_t)B * (size_t)(2 * H + I), &failed);
#pragma omp barrier
        if (!failed) {
            float *resid = mine, *xn = resid + B * H, *act = xn + B * H;
            for (int64_t b = 0; b < B; b++) embed_row(m, ids[b], xn + b * H);
            for (int64_t l = 0; l < m->num_layers; l++) {
                const DecoderLayer *L = &m->layers[l];
                for (int64_t b = 0; b < B; b++)
                    add_rms_norm_row(l == 0 ? xn + b * H : proj + b * H, resid + b * H, l == 0, L->input_norm, m->eps,
                                     H, xn + b * H);
                linear_rows_for(&L->qkv, xn, H, B, qkv, QKV);
                phase_rope_attention(m, L, qkv, positions, slots, block_tables, context_lens, B, max_blocks,
                                     max_context, per_item, attn, scores, inv_sum);
                linear_rows_for(&L->o, attn, Q, B, proj, H);
                for (int64_t b = 0; b < B; b++)
                    add_rms_norm_row(proj + b * H, resid + b * H, 0, L->post_norm, m->eps, H, xn + b * H);
                linear_rows_for(&L->gate_up, xn, H, B, gu, 2 * I);
                for (int64_t b = 0; b < B; b++) silu_mul_span(gu + b * 2 * I, gu + b * 2 * I + I, 0, I, act + b * I);
                linear_rows_for(&L->down, act, I, B, proj, H);
            }
            for (int64_t b = 0; b < B; b++)
                add_rms_norm_row(proj + b * H, resid + b * H, 0, m->final_norm, m->eps, H, xn + b * H);
            linear_rows_for(&m->head, xn, H, B, logits, m->head.n);
        }
        free(mine);
        free(scores);
        free(inv_sum);
    }
    free(buf);
    return failed;
}

/* ---- a layer's phases one call each, between matmuls done elsewhere (larger batches: oneDNN) --- */

void decode_add_rms_norm(const DecoderModel *m, const float *x, float *resid, int first, const float *weight,
                         int64_t num_seqs, float *y, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    phase_add_norm(x, resid, first, weight, m->eps, num_seqs, m->hidden, y);
}

/* Layer `layer`'s rotary + KV store + attention: qkv [num_seqs, q | k | v] (q and k rotated in
 * place) -> attn [num_seqs, num_heads * head_dim]. Returns 0, or 1 when a buffer could not be
 * allocated. */
int decode_attention_layer(const DecoderModel *m, int64_t layer, float *qkv, const int64_t *positions,
                           const int64_t *slots, const int32_t *block_tables, const int32_t *context_lens,
                           int64_t num_seqs, int64_t max_blocks, int64_t max_context, float *attn, int num_threads) {
    const DecoderLayer *L = &m->layers[layer];
    const int64_t per_item = kv_heads_per_item(num_seqs, m->num_kv_heads, num_threads);
    const int64_t heads = per_item * (m->num_heads / m->num_kv_heads);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = alloc_or_flag((size_t)(heads * max_context), &failed);
        float *inv_sum = alloc_or_flag((size_t)heads, &failed);
        phase_rope_attention(m, L, qkv, positions, slots, block_tables, context_lens, num_seqs, max_blocks,
                             max_context, per_item, attn, scores, inv_sum);
        free(scores);
        free(inv_sum);
    }
    return failed;
}

/* Layer `layer`'s q/k norm + rotary (in place) and KV store of num_rows tokens, qkv [num_rows, q | k | v]
 * (a prefill's tokens, whose attention runs elsewhere). */
void rope_store_layer(const DecoderModel *m, int64_t layer, float *qkv, const int64_t *positions, const int64_t *slots,
                      int64_t num_rows, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    phase_rope_store(m, &m->layers[layer], qkv, positions, slots, num_rows);
}

void decode_silu_mul(const float *gu, int64_t num_seqs, int64_t intermediate, float *act, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    phase_silu_mul(gu, num_seqs, intermediate, act);
}
