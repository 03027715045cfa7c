/* The decode step of a Llama-family decoder (Llama, Qwen2, Qwen3) in C: the embedding lookup;
 * for every layer, residual add + RMSNorm, the qkv projection, q/k RMSNorm (Qwen3), rotary
 * embedding, the KV-cache store, paged attention, the output projection, residual add + RMSNorm,
 * the gated MLP; then the final norm and the LM head. One token per sequence. The hybrids
 * (Qwen3.5, Qwen3-Next) add two layer kinds, one-call only: attention with an output gate and
 * partial rotary (attn_gate), and Gated DeltaNet (linear: cpu_deltanet.c's phase in place of the
 * attention, its state in each sequence's slot).
 *
 * The eager forward runs ~140 small torch ops per layer, whose dispatch costs more than the
 * weight traffic at one or a few sequences; decode_layers runs a range of layers in one OpenMP
 * parallel region: the matmuls and the attention (each work item rotating and storing its own
 * heads first) are worksharing loops, whose ends are the only synchronisation, and every thread
 * computes the norms and SiLU of the few rows itself. Same math as the torch path, fp32
 * activations; weights in any format of the weight-type table (cpu_kernels.c). A layer whose
 * matrices the description lacks (in_c 0) is run between ranges by its own module, calling the
 * phases below.
 *
 * Larger batches keep their matmuls on oneDNN, which uses the cores better there, and call the
 * phases between them one at a time (decode_add_rms_norm, decode_attention_layer,
 * decode_silu_mul): four C calls per layer instead of ~130 torch ops. Prefill steps do the same with
 * rope_store_layer in place of decode_attention_layer (their attention stays torch's SDPA).
 * The structures are declared in cpu_kernels.h. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

/* resid (+)= x; y = weight * (resid / rms(resid)), one row of n. */
static void add_rms_norm_row(const float *x, float *resid, int first, const float *weight, float eps, float scale,
                             int64_t n, float *y) {
    float sq = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float r = first ? x[i] : resid[i] + scale * x[i];
        resid[i] = r;
        sq += r * r;
    }
    const float inv = 1.0f / sqrtf(sq / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = weight[i] * (resid[i] * inv);
}

/* In place: optional RMSNorm over the head (q/k norm), then neox-style rotation of its first
 * rotary_dim values by cos/sin (the rest as they are: partial rotary). */
static void norm_rope_head(float *x, const float *norm, float eps, const float *cos_sin, int64_t head_dim,
                           int64_t rotary_dim) {
    if (norm != NULL) {
        float sq = 0.0f;
        for (int64_t d = 0; d < head_dim; d++) sq += x[d] * x[d];
        const float inv = 1.0f / sqrtf(sq / (float)head_dim + eps);
        for (int64_t d = 0; d < head_dim; d++) x[d] = norm[d] * (x[d] * inv);
    }
    const int64_t half = rotary_dim / 2;
    const float *cos = cos_sin, *sin = cos_sin + half;
    for (int64_t d = 0; d < half; d++) {
        const float x1 = x[d], x2 = x[d + half];
        x[d] = x1 * cos[d] - x2 * sin[d];
        x[d + half] = x2 * cos[d] + x1 * sin[d];
    }
}

/* x [H] = the embedding row of token id, as fp32. */
static void embed_row(const DecoderModel *m, int64_t id, float *x) {
    weight_types[m->embed.type].row_to_f32(&m->embed, id, x);
    if (m->embed_scale != 1.0f)
        for (int64_t i = 0; i < m->hidden; i++) x[i] *= m->embed_scale;
}

/* ---- the phases of a layer: orphaned worksharing loops, run inside a parallel region ---------- */

/* Rows b < B: resid (+)= scale x; y = norm(resid). */
static void phase_add_norm(const float *x, float *resid, int first, const float *weight, float eps, float scale,
                           int64_t B, int64_t H, float *y) {
#pragma omp for
    for (int64_t b = 0; b < B; b++) add_rms_norm_row(x + b * H, resid + b * H, first, weight, eps, scale, H, y + b * H);
}

/* Token b's query heads of KV heads [kv_first, kv_end) and those KV heads, in qkv [B, q | k | v]:
 * norm + rotary in place; each k head is stored with its v head in the token's cache slot (slot
 * < 0: not stored). */
static void rope_store_heads(const DecoderModel *m, const DecoderLayer *L, float *qkv, const int64_t *positions,
                             const int64_t *slots, int64_t b, int64_t kv_first, int64_t kv_end) {
    const int64_t D = m->head_dim, NH = m->num_heads, NKV = m->num_kv_heads, group = NH / NKV;
    const int64_t Q = NH * D, KV = NKV * D;
    float *row = qkv + b * (Q + 2 * KV);
    const int64_t R = L->no_rope ? 0 : m->rotary_dim; /* 0: no rotation (norm_rope_head) */
    const float *cs = m->cos_sin + positions[b] * R;
    for (int64_t h = kv_first * group; h < kv_end * group; h++) norm_rope_head(row + h * D, L->q_norm, m->eps, cs, D, R);
    for (int64_t kh = kv_first; kh < kv_end; kh++) {
        float *k = row + Q + kh * D;
        norm_rope_head(k, L->k_norm, m->eps, cs, D, R);
        if (slots[b] >= 0) {
            const int64_t at = (slots[b] * NKV + kh) * kv_row_bytes(m->kv_type, D);
            kv_store_row(m->kv_type, (uint8_t *)L->k_cache + at, k, D);
            kv_store_row(m->kv_type, (uint8_t *)L->v_cache + at, row + Q + KV + kh * D, D);
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

typedef struct {
    const DecoderModel *m;
    const DecoderLayer *L;
    float *qkv;
    const DecodeStep *s;
} RopeStore;

static void rope_store_item(const void *ctx, int64_t b, int64_t kv_first, int64_t kv_end) {
    const RopeStore *c = ctx;
    rope_store_heads(c->m, c->L, c->qkv, c->s->positions, c->s->slots, b, kv_first, kv_end);
}

/* attn [B, num_heads * head_dim] = paged attention of each row's q over its cached tokens, in the
 * plan's work items (decode_plan). Whole-sequence items first rotate their own q/k heads and store
 * their new K/V rows (rope_store_heads: the item's heads are the only ones it reads, so no barrier
 * is needed between the two); items that split a sequence's tokens wait for all of them to be
 * stored. scratch: decode_scratch_floats per thread; parts: decode_partial_floats, shared. */
static void phase_rope_attention(const DecoderModel *m, const DecoderLayer *L, float *qkv, const DecodeStep *s,
                                 const DecodePlan *plan, float *attn, float *scratch, float *parts) {
    const int64_t D = m->head_dim, NH = m->num_heads, NKV = m->num_kv_heads, B = s->num_seqs;
    const int64_t Q = NH * D, QKV = Q + 2 * NKV * D;
    const RopeStore ctx = {m, L, qkv, s};
    const int stored = plan->splits > 1 || s->store_first;
    if (stored) phase_rope_store(m, L, qkv, s->positions, s->slots, B); /* ends in a barrier */
    phase_decode_attention(qkv, QKV, L->k_cache, L->v_cache, m->kv_type, s->block_tables, s->max_blocks,
                           s->context_lens, attn, Q, B, NH, NKV, D, m->block_size, m->scale, L->window, 0.0f, L->sinks, plan, scratch, parts,
                           stored ? NULL : rope_store_item, &ctx);
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

/* Gated attention (attn_gate): raw [B, NH (q_h | gate_h) | k | v] -> qkv [B, q | k | v] and gate [B, NH D]. */
static void phase_split_gate(const float *raw, int64_t B, int64_t NH, int64_t NKV, int64_t D, float *qkv, float *gate) {
    const int64_t Q = NH * D, KV = NKV * D;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; b++) {
        const float *r = raw + b * (2 * Q + 2 * KV);
        float *out = qkv + b * (Q + 2 * KV), *g = gate + b * Q;
        for (int64_t h = 0; h < NH; h++) {
            memcpy(out + h * D, r + 2 * h * D, sizeof(float) * (size_t)D);
            memcpy(g + h * D, r + (2 * h + 1) * D, sizeof(float) * (size_t)D);
        }
        memcpy(out + Q, r + 2 * Q, sizeof(float) * (size_t)(2 * KV));
    }
}

/* attn [n] *= sigmoid(gate [n]), in 8-lane chunks. */
static void phase_apply_gate(float *attn, const float *gate, int64_t n) {
    const int64_t chunks = (n + VL - 1) / VL;
#pragma omp for schedule(static)
    for (int64_t j = 0; j < chunks; j++) {
        const int64_t end = (j + 1) * VL < n ? (j + 1) * VL : n;
        for (int64_t i = j * VL; i < end; i++) attn[i] /= 1.0f + sexp(-gate[i]);
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

/* Whether m can be run: every matrix of the layers marked in_c, the embedding and the head where
 * given, valid (linear_is_valid), and a KV format that takes head_dim. Returns -1, or the index of
 * the first layer with a bad matrix (num_layers: the embedding, the head or the KV format). Called
 * once, when the description is built. */
int64_t decode_check_model(const DecoderModel *m) {
    if (kv_row_bytes(m->kv_type, m->head_dim) == 0 || m->rotary_dim <= 0 || m->rotary_dim > m->head_dim ||
        m->rotary_dim % 2)
        return m->num_layers;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const DecoderLayer *L = &m->layers[l];
        const DeltaNetLayer *X = L->linear;
        const ShortConvLayer *S = L->short_conv;
        const Mamba2Layer *M = L->mamba2;
        const int64_t H = m->hidden, Q = m->num_heads * m->head_dim, KV = m->num_kv_heads * m->head_dim;
        int64_t proj_out = (L->attn_gate ? 2 * Q : Q) + 2 * KV, o_in = Q;
        if (L->kv_group < 0) return l;
        /* a gated, linear or short-conv layer has no phases for run_layer: it runs in the one call only */
        if (!L->in_c) {
            if (L->attn_gate || X != NULL || S != NULL || M != NULL) return l;
            continue;
        }
        if (M != NULL) {
            const int64_t inner = M->heads * M->p;
            if (M->conv_w == NULL || M->conv_b == NULL || M->conv_state == NULL || M->ssm == NULL || M->A_log == NULL ||
                M->D == NULL || M->dt_bias == NULL || M->heads <= 0 || M->p <= 0 || M->n <= 0 ||
                M->groups <= 0 || M->heads % M->groups || M->heads_per_group * M->groups != M->heads || M->K < 2 ||
                M->K > 8 || M->norm_width <= 0 || inner % M->norm_width || X != NULL || S != NULL ||
                L->attn_gate || !linear_is_valid(&M->proj) || !linear_is_valid(&M->out) || M->proj.k != H ||
                linear_outputs(&M->proj) != 2 * inner + M->heads + 2 * M->groups * M->n || M->out.k != inner ||
                linear_outputs(&M->out) != H)
                return l;
            if (L->qkv.data == NULL) {  /* the layer's only mixer: no attention matrices to check */
                proj_out = 0;
                o_in = 0;
            }
        }
        if (S != NULL) {
            if (S->conv_w == NULL || S->conv_state == NULL || S->C <= 0 || S->K < 2 || S->K > 8 || X != NULL ||
                L->attn_gate)
                return l;
            proj_out = 3 * S->C;
            o_in = S->C;
        }
        if (X != NULL) {
            if (X->conv_w == NULL || X->conv_state == NULL || X->state == NULL || X->A_log == NULL ||
                X->dt_bias == NULL || X->norm == NULL || X->nk <= 0 || X->nv % X->nk || X->dk <= 0 || X->dv <= 0 ||
                X->dv > 1024 || X->K < 2 || X->K > 8 || L->attn_gate)
                return l;
            proj_out = 2 * X->nk * X->dk + X->nv * X->dv + X->nv * X->dv + 2 * X->nv;
            o_in = X->nv * X->dv;
        }
        if (proj_out > 0 && !(linear_is_valid(&L->qkv) && linear_is_valid(&L->o) && L->qkv.k == H &&
                              linear_outputs(&L->qkv) == proj_out && L->o.k == o_in && linear_outputs(&L->o) == H))
            return l;
        if (L->moe != NULL ? !(moe_is_valid(L->moe) && L->moe->hidden == H && L->moe->router.data != NULL &&
                               (L->moe->shared_down.data == NULL || L->moe->shared_down.k <= m->intermediate))
                           : !(linear_is_valid(&L->gate_up) && linear_is_valid(&L->down) && L->down.k <= m->intermediate &&
                               L->gate_up.k == H && linear_outputs(&L->gate_up) == 2 * L->down.k &&
                               linear_outputs(&L->down) == H))
            return l;
    }
    if ((m->embed.data != NULL && (!linear_is_valid(&m->embed) || m->embed.next != NULL || m->embed.k != m->hidden)) ||
        (m->head.data != NULL && (!linear_is_valid(&m->head) || m->head.next != NULL || m->head.k != m->hidden)))
        return m->num_layers;
    return -1;
}

/* Layer l's adapter slots of its matrix `which` (0 qkv, 1 o, 2 gate_up, 3 down), NULL where none. */
#define LORA(which) (lora != NULL && lora->mats[l * 4 + (which)].a != NULL ? &lora->mats[l * 4 + (which)] : NULL)

/* ---- layers [first_layer, end_layer) of a decode step in one call ------------------------------
 * The residual stream between layers is (hidden, resid): a layer's input is norm(resid += hidden)
 * (resid = hidden when resid_started is 0, before the first layer). ids != NULL: hidden is the
 * embedding of ids (first_layer 0). On return hidden is the last layer's output and resid the
 * stream so far; with logits != NULL (end_layer == num_layers, head given) the final norm and the
 * LM head fill logits [num_seqs, vocab] instead. Every layer in the range must be in_c. s: the
 * step of each KV group (a layer reads s[its kv_group]).
 * lora != NULL: rows with an adapter slot add their adapter's update after each matmul it describes
 * (cpu_lora.c; only attention layers without a gate and dense MLPs: the caller runs other steps
 * elsewhere).
 * Returns 0; 1 when a buffer could not be allocated, 2 for a token id outside the vocabulary, 3
 * for a range or layer the description cannot run (nothing is computed then). */
int decode_layers(const DecoderModel *m, const DecodeStep *s, const int64_t *ids, int64_t first_layer,
                  int64_t end_layer, float *hidden, float *resid, int resid_started, float *logits,
                  const LoraStep *lora, int num_threads) {
    const int64_t H = m->hidden, NH = m->num_heads, NKV = m->num_kv_heads, D = m->head_dim;
    const int64_t I = m->intermediate, Q = NH * D, QKV = Q + 2 * NKV * D, B = s->num_seqs;
    if (first_layer < 0 || end_layer > m->num_layers || first_layer >= end_layer ||
        (logits != NULL && (end_layer != m->num_layers || m->head.data == NULL)) ||
        (ids != NULL && (first_layer != 0 || m->embed.data == NULL)))
        return 3;
    /* Per row: the projections of gated and linear layers (proj), the linear layers' convolved
     * channels (conv), the gated layers' gates (gate); the attention output, the widest of Q and the
     * linear layers' values. */
    int64_t P = 0, Cmax = 0, G = 0, A = Q, side = 0;
    for (int64_t l = first_layer; l < end_layer; l++) {
        const DecoderLayer *L = &m->layers[l];
        const int stateful = L->linear != NULL || L->short_conv != NULL || L->mamba2 != NULL;
        if (!L->in_c || (stateful && s[L->kv_group].state_slots == NULL)) return 3;
        if (L->linear != NULL || L->short_conv != NULL || L->attn_gate)
            P = linear_outputs(&L->qkv) > P ? linear_outputs(&L->qkv) : P;
        if (L->short_conv != NULL) A = L->short_conv->C > A ? L->short_conv->C : A;
        if (L->mamba2 != NULL) {
            const Mamba2Layer *M = L->mamba2;
            const int64_t inner = M->heads * M->p, C = inner + 2 * M->groups * M->n;
            P = linear_outputs(&M->proj) > P ? linear_outputs(&M->proj) : P;
            A = inner > A ? inner : A;
            Cmax = C > Cmax ? C : Cmax;
            if (L->qkv.data != NULL) side = H;  /* attention beside it: its output summed in */
        }
        if (L->attn_gate) G = Q;
        if (L->linear != NULL) {
            const DeltaNetLayer *X = L->linear;
            const int64_t C = 2 * X->nk * X->dk + X->nv * X->dv;
            Cmax = C > Cmax ? C : Cmax;
            A = X->nv * X->dv > A ? X->nv * X->dv : A;
        }
    }
    for (int64_t b = 0; ids != NULL && b < B; b++)
        if (ids[b] < 0 || ids[b] >= m->embed.n) return 2;
    /* The activations every thread writes a share of: qkv, attention output, gate|up; for sparse
     * MoE layers their router logits, shared expert output and gate, and phase_moe's scratch. */
    int64_t experts = 0, moe_floats = 0;
    for (int64_t l = first_layer; l < end_layer; l++) {
        const MoeExperts *X = m->layers[l].moe;
        if (X == NULL) continue;
        experts = X->num_experts > experts ? X->num_experts : experts;
        moe_floats = moe_scratch_floats(X, B) > moe_floats ? moe_scratch_floats(X, B) : moe_floats;
    }
    const int64_t moe_total = experts > 0 ? B * (experts + H + 1) + moe_floats : 0;
    const DecodePlan plan = decode_plan(B, NKV, s->max_context, m->block_size, num_threads);
    const int64_t partial = decode_partial_floats(&plan, B, NH, D);
    const int64_t lora_width = lora != NULL ? lora->width : 0;
    const int64_t per_row = QKV + A + 2 * I + P + Cmax + G + lora_width + side;
    float *buf = malloc(sizeof(float) * (size_t)(B * per_row + moe_total + partial));
    if (buf == NULL) return 1;
    float *qkv = buf, *attn = qkv + B * QKV, *gu = attn + B * A, *proj = gu + B * 2 * I, *conv = proj + B * P;
    float *gate = conv + B * Cmax, *lora_t = gate + B * G, *beside = lora_t + B * lora_width;
    float *router_logits = beside + B * side, *shared_y = router_logits + B * experts, *shared_gate = shared_y + B * H;
    float *moe_scratch = shared_gate + B, *parts = buf + B * per_row + moe_total;
    int failed = 0;
    const int64_t failures = kernel_failures();
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = alloc_or_flag((size_t)decode_scratch_floats(&plan, NH / NKV), &failed);
        /* Each thread's own residual stream, normed input and SiLU output: the norms and SiLU
         * (a few thousand floats at 1-2 rows) are computed by every thread alike, so the matmul
         * after them needs no barrier of its own (5 per layer instead of 9). */
        float *mine = alloc_or_flag((size_t)B * (size_t)(2 * H + I), &failed);
#pragma omp barrier
        if (!failed) {
            float *rs = mine, *xn = rs + B * H, *act = xn + B * H;
            const float *first_in = hidden;
            int started = resid_started;
            if (ids != NULL) {
                for (int64_t b = 0; b < B; b++) embed_row(m, ids[b], xn + b * H);
                first_in = xn;
                started = 0;
            } else if (started) {
                memcpy(rs, resid, sizeof(float) * (size_t)(B * H));
            }
            /* NOTE: hidden is read by every thread here and written by the o and down matmuls:
             * the worksharing loops between them end in barriers. */
            for (int64_t l = first_layer; l < end_layer; l++) {
                const DecoderLayer *L = &m->layers[l];
                const int64_t Il = L->down.k;
                for (int64_t b = 0; b < B; b++)
                    add_rms_norm_row((l == first_layer ? first_in : hidden) + b * H, rs + b * H,
                                     l == first_layer && !started, L->input_norm, m->eps, m->residual_scale, H,
                                     xn + b * H);
                if (L->linear != NULL) {  /* Gated DeltaNet: in_proj, conv + delta rule + gated norm, out_proj */
                    const DeltaNetLayer *X = L->linear;
                    const int64_t Pl = linear_outputs(&L->qkv);
                    linear_rows_for(&L->qkv, xn, H, B, proj, Pl);
                    phase_deltanet(X, proj, Pl, B, s[L->kv_group].state_slots, m->eps, attn, conv);
                    linear_rows_for(&L->o, attn, X->nv * X->dv, B, hidden, H);
                } else if (L->mamba2 != NULL) {  /* Mamba-2: in_proj | bc_proj, conv + SSM + gated norm, out_proj */
                    const Mamba2Layer *X = L->mamba2;
                    const int64_t Pl = linear_outputs(&X->proj);
                    linear_rows_for(&X->proj, xn, H, B, proj, Pl);
                    phase_mamba2(X, proj, Pl, B, s[L->kv_group].state_slots, m->eps, attn, conv);
                    linear_rows_for(&X->out, attn, X->heads * X->p, B, hidden, H);
                    if (L->qkv.data != NULL) {  /* attention beside it on the same input (Falcon-H1) */
                        linear_rows_for(&L->qkv, xn, H, B, qkv, QKV);
                        phase_rope_attention(m, L, qkv, s + L->kv_group, &plan, attn, scratch, parts);
                        linear_rows_for(&L->o, attn, Q, B, beside, H);
#pragma omp for schedule(static)
                        for (int64_t i = 0; i < B * H; i++) hidden[i] += beside[i];
                    }
                } else if (L->short_conv != NULL) {  /* short convolution: in_proj, C * conv(B * x), out_proj */
                    const ShortConvLayer *X = L->short_conv;
                    linear_rows_for(&L->qkv, xn, H, B, proj, 3 * X->C);
                    phase_short_conv(X, proj, B, s[L->kv_group].state_slots, attn);
                    linear_rows_for(&L->o, attn, X->C, B, hidden, H);
                } else if (L->attn_gate) {  /* attention with an output gate */
                    linear_rows_for(&L->qkv, xn, H, B, proj, 2 * Q + 2 * NKV * D);
                    phase_split_gate(proj, B, NH, NKV, D, qkv, gate);
                    phase_rope_attention(m, L, qkv, s + L->kv_group, &plan, attn, scratch, parts);
                    phase_apply_gate(attn, gate, B * Q);
                    linear_rows_for(&L->o, attn, Q, B, hidden, H);
                } else {
                    linear_rows_for(&L->qkv, xn, H, B, qkv, QKV);
                    if (LORA(0)) phase_lora(LORA(0), xn, H, B, lora->row_slots, lora_t, qkv, QKV);
                    phase_rope_attention(m, L, qkv, s + L->kv_group, &plan, attn, scratch, parts);
                    linear_rows_for(&L->o, attn, Q, B, hidden, H);
                    if (LORA(1)) phase_lora(LORA(1), attn, Q, B, lora->row_slots, lora_t, hidden, H);
                }
                for (int64_t b = 0; b < B; b++)
                    add_rms_norm_row(hidden + b * H, rs + b * H, 0, L->post_norm, m->eps, m->residual_scale, H,
                                     xn + b * H);
                if (L->moe != NULL) {
                    /* sparse MoE: the router, the shared expert (its act per thread, as below), the experts */
                    const MoeExperts *X = L->moe;
                    const int64_t Is = X->shared_down.data != NULL ? X->shared_down.k : 0;
                    linear_rows_for(&X->router, xn, H, B, router_logits, X->num_experts);
                    if (Is > 0) {
                        linear_rows_for(&X->shared_gate_up, xn, H, B, gu, 2 * Is);
                        if (X->shared_gate.data != NULL) linear_rows_for(&X->shared_gate, xn, H, B, shared_gate, 1);
                        for (int64_t b = 0; b < B; b++)
                            silu_mul_span(gu + b * 2 * Is, gu + b * 2 * Is + Is, 0, Is, act + b * Is);
                        linear_rows_for(&X->shared_down, act, Is, B, shared_y, H);
                    }
                    phase_moe(X, xn, B, router_logits, Is > 0 ? shared_y : NULL, shared_gate, hidden, moe_scratch);
                    continue;
                }
                linear_rows_for(&L->gate_up, xn, H, B, gu, 2 * Il);
                if (LORA(2)) phase_lora(LORA(2), xn, H, B, lora->row_slots, lora_t, gu, 2 * Il);
                for (int64_t b = 0; b < B; b++) silu_mul_span(gu + b * 2 * Il, gu + b * 2 * Il + Il, 0, Il, act + b * Il);
                linear_rows_for(&L->down, act, Il, B, hidden, H);
                if (LORA(3)) phase_lora(LORA(3), act, Il, B, lora->row_slots, lora_t, hidden, H);
            }
            if (logits != NULL) {
                for (int64_t b = 0; b < B; b++)
                    add_rms_norm_row(hidden + b * H, rs + b * H, 0, m->final_norm, m->eps, m->residual_scale, H,
                                     xn + b * H);
                linear_rows_for(&m->head, xn, H, B, logits, m->head.n);
                if (m->logit_scale != 1.0f) {
#pragma omp for schedule(static)
                    for (int64_t i = 0; i < B * m->head.n; i++) logits[i] *= m->logit_scale;
                }
            } else {
#pragma omp single
                memcpy(resid, rs, sizeof(float) * (size_t)(B * H));
            }
        }
        free(mine);
        free(scratch);
    }
    free(buf);
    return failed ? failed : kernel_failures() != failures ? 1 : 0;
}

/* ---- a layer's phases one call each, between matmuls done elsewhere (larger batches: oneDNN) --- */

void decode_add_rms_norm(const DecoderModel *m, const float *x, float *resid, int first, const float *weight,
                         int64_t num_seqs, float *y, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    phase_add_norm(x, resid, first, weight, m->eps, m->residual_scale, num_seqs, m->hidden, y);
}

/* Layer `layer`'s rotary + KV store + attention: qkv [num_seqs, q | k | v] (q and k rotated in
 * place) -> attn [num_seqs, num_heads * head_dim]. Returns 0, 1 when a buffer could not be
 * allocated, 3 for a gated or linear layer (decode_layers runs those). */
int decode_attention_layer(const DecoderModel *m, int64_t layer, float *qkv, const DecodeStep *s, float *attn,
                           int num_threads) {
    const DecoderLayer *L = &m->layers[layer];
    if (L->attn_gate || L->linear != NULL || L->short_conv != NULL || L->mamba2 != NULL)
        return 3;  /* those run in decode_layers only */
    const DecodePlan plan = decode_plan(s->num_seqs, m->num_kv_heads, s->max_context, m->block_size, num_threads);
    const int64_t partial = decode_partial_floats(&plan, s->num_seqs, m->num_heads, m->head_dim);
    float *parts = NULL;
    if (partial > 0 && (parts = malloc(sizeof(float) * (size_t)partial)) == NULL) return 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = alloc_or_flag((size_t)decode_scratch_floats(&plan, m->num_heads / m->num_kv_heads), &failed);
        phase_rope_attention(m, L, qkv, s + L->kv_group, &plan, attn, scratch, parts);
        free(scratch);
    }
    free(parts);
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
