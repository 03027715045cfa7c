/* The experts of a sparse mixture-of-experts layer (layers/moe.py) on few or many rows: each row's
 * top-k experts from its router logits (softmax, optionally renormalized over the chosen), the
 * (row, expert) pairs grouped by expert, and each expert that receives a pair run once over its
 * rows, so its weights are read once per call and an expert no row chose is not read at all: at
 * one row a step reads the top-k experts' bytes, not all of them.
 *
 * phase_moe is a sequence of orphaned worksharing loops (run inside a parallel region, as
 * decode_layers does for a whole decode step); moe_experts_f32 wraps it in a region of its own for
 * the layer's module (prefill and larger decode steps). The experts' matrices are in any format of
 * the weight-type table, the same kernels as the dense layers. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

/* Row b's top-k experts by logit (ties: the lower index), their softmax probabilities over all
 * experts, renormalized over the k when asked. */
static void route_softmax(const float *logits, int64_t E, int64_t k, int renormalize, int64_t *ids, float *w) {
    float max = logits[0];
    for (int64_t e = 1; e < E; e++) max = logits[e] > max ? logits[e] : max;
    float sum = 0.0f;
    for (int64_t e = 0; e < E; e++) sum += expf(logits[e] - max);
    float chosen_sum = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        ids[j] = best;
        w[j] = expf(logits[best] - max) / sum;
        chosen_sum += w[j];
    }
    if (renormalize)
        for (int64_t j = 0; j < k; j++) w[j] /= chosen_sum;
}

/* The index of the largest of v[0..n) not excluded (ties: the lower index), or -1. */
static int64_t best_of(const float *v, int64_t n, const unsigned char *excluded) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; i++)
        if (!excluded[i] && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

/* The grouped rule (MoeExperts.n_group > 0) for one row. */
static void route_grouped(const MoeExperts *m, const float *logits, int64_t *ids, float *w) {
    const int64_t E = m->num_experts, k = m->top_k, G = m->n_group, per = E / G;
    float score[E], choice[E], group[G];
    unsigned char closed[E], skip[G];
    for (int64_t e = 0; e < E; e++) {
        score[e] = 1.0f / (1.0f + expf(-logits[e]));
        choice[e] = score[e] + m->correction_bias[e];
    }
    for (int64_t g = 0; g < G; g++) { /* the sum of the group's two best biased scores */
        const float *c = choice + g * per;
        int64_t first = 0;
        for (int64_t i = 1; i < per; i++) first = c[i] > c[first] ? i : first;
        int64_t second = -1;
        for (int64_t i = 0; i < per; i++)
            if (i != first && (second < 0 || c[i] > c[second])) second = i;
        group[g] = c[first] + (second >= 0 ? c[second] : 0.0f);
        skip[g] = 0;
    }
    memset(closed, 1, (size_t)E);
    for (int64_t j = 0; j < m->topk_group; j++) { /* open the best topk_group groups */
        const int64_t g = best_of(group, G, skip);
        skip[g] = 1;
        memset(closed + g * per, 0, (size_t)per);
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        const int64_t e = best_of(choice, E, closed);
        closed[e] = 1;
        ids[j] = e;
        w[j] = score[e];
        sum += score[e];
    }
    for (int64_t j = 0; j < k; j++) w[j] = (m->renormalize ? w[j] / (sum + 1e-20f) : w[j]) * m->routed_scale;
}

static void route_row(const MoeExperts *m, const float *logits, int64_t *ids, float *w) {
    if (m->n_group > 0)
        route_grouped(m, logits, ids, w);
    else
        route_softmax(logits, m->num_experts, m->top_k, (int)m->renormalize, ids, w);
}

int64_t moe_scratch_floats(const MoeExperts *m, int64_t B) {
    const int64_t P = B * m->top_k, H = m->hidden, I = m->intermediate;
    /* ids, order, position and start (int64: 2 floats each), the weights, the pairs' rows */
    return 2 * (3 * P + m->num_experts + 1) + P + P * (H + 2 * I + I + H);
}

/* out [B, H] = sum over each row's top-k experts of weight * expert(x row), plus
 * sigmoid(shared_gate[b]) * shared[b] when shared != NULL. scratch: moe_scratch_floats(m, B)
 * floats, shared by the threads. */
void phase_moe(const MoeExperts *m, const float *x, int64_t B, const float *logits, const float *shared,
               const float *shared_gate, float *out, float *scratch) {
    const int64_t E = m->num_experts, k = m->top_k, H = m->hidden, I = m->intermediate, P = B * k;
    /* the int64 arrays first, so that they are 8-byte aligned whatever P */
    int64_t *ids = (int64_t *)scratch, *order = ids + P, *position = order + P, *start = position + P;
    float *w = (float *)(start + E + 1), *xg = w + P, *gu = xg + P * H, *act = gu + P * 2 * I, *yd = act + P * I;
#pragma omp single
    {
        for (int64_t b = 0; b < B; b++) route_row(m, logits + b * E, ids + b * k, w + b * k);
        /* counting sort of the pairs by expert: start[e] is expert e's first place in order */
        for (int64_t e = 0; e <= E; e++) start[e] = 0;
        for (int64_t p = 0; p < P; p++) start[ids[p] + 1]++;
        for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
        for (int64_t p = 0; p < P; p++) {
            const int64_t place = start[ids[p]]++;
            order[place] = p;
            position[p] = place;
        }
        for (int64_t e = E; e > 0; e--) start[e] = start[e - 1];
        start[0] = 0;
    }
#pragma omp for schedule(static)
    for (int64_t place = 0; place < P; place++) memcpy(xg + place * H, x + (order[place] / k) * H, sizeof(float) * (size_t)H);
    /* the chosen experts back to back, one barrier after all of them (at one row: 2 a layer, not 16) */
    for (int64_t e = 0; e < E; e++) {
        const int64_t first = start[e], rows = start[e + 1] - first;
        if (rows > 0) linear_rows_nowait(&m->gate_up[e], xg + first * H, H, rows, gu + first * 2 * I, 2 * I);
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t place = 0; place < P; place++) {
        const float *g = gu + place * 2 * I, *u = g + I;
        float *a = act + place * I;
        if (m->activation == MOE_SWIGLU_OAI)
            for (int64_t i = 0; i < I; i++) {
                const float gi = g[i] < m->limit ? g[i] : m->limit;
                const float ui = u[i] < -m->limit ? -m->limit : u[i] > m->limit ? m->limit : u[i];
                a[i] = (ui + 1.0f) * gi / (1.0f + expf(-m->alpha * gi));
            }
        else
            silu_mul_span(g, u, 0, I, a);
    }
    for (int64_t e = 0; e < E; e++) {
        const int64_t first = start[e], rows = start[e + 1] - first;
        if (rows > 0) linear_rows_nowait(&m->down[e], act + first * I, I, rows, yd + first * H, H);
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; b++) {
        float *o = out + b * H;
        const float gate = shared == NULL ? 0.0f : m->shared_gate.data == NULL ? 1.0f : 1.0f / (1.0f + expf(-shared_gate[b]));
        for (int64_t i = 0; i < H; i++) o[i] = shared != NULL ? gate * shared[b * H + i] : 0.0f;
        for (int64_t j = 0; j < k; j++) {
            const float wj = w[b * k + j], *y = yd + position[b * k + j] * H;
            for (int64_t i = 0; i < H; i++) o[i] += wj * y[i];
        }
    }
}

/* Whether every expert's matrices are valid and shaped [2I, H] / [H, I], the router [E, H], and
 * the shared expert's (where given) [2 Is, H], [H, Is] and its gate's (where given) [1, H]. */
int moe_is_valid(const MoeExperts *m) {
    const int64_t E = m->num_experts, H = m->hidden, I = m->intermediate;
    if (E <= 0 || m->top_k <= 0 || m->top_k > E || m->gate_up == NULL || m->down == NULL ||
        (m->activation != MOE_SILU && m->activation != MOE_SWIGLU_OAI))
        return 0;
    if (m->n_group < 0 || (m->n_group > 0 && (E % m->n_group || m->topk_group <= 0 || m->topk_group > m->n_group ||
                                              m->top_k > m->topk_group * (E / m->n_group) || m->correction_bias == NULL)))
        return 0;
    if (m->router.data != NULL && !(linear_is_valid(&m->router) && m->router.k == H && linear_outputs(&m->router) == E))
        return 0;
    for (int64_t e = 0; e < E; e++) {
        const Linear *g = &m->gate_up[e], *d = &m->down[e];
        if (!linear_is_valid(g) || !linear_is_valid(d) || g->k != H || linear_outputs(g) != 2 * I || d->k != I ||
            linear_outputs(d) != H)
            return 0;
    }
    if (m->shared_down.data != NULL) {
        const Linear *g = &m->shared_gate_up, *d = &m->shared_down, *s = &m->shared_gate;
        if (!linear_is_valid(g) || !linear_is_valid(d) || g->k != H || linear_outputs(g) != 2 * d->k ||
            linear_outputs(d) != H || (s->data != NULL && (!linear_is_valid(s) || s->k != H || linear_outputs(s) != 1)))
            return 0;
    }
    return 1;
}

/* out [rows, H] = the routed experts of x [rows, H] under router logits [rows, E] (no shared
 * expert: the module adds its own). Returns 0; 1 when the scratch (its own or a row loop's) cannot be allocated, 3 when m
 * is not valid. */
int moe_experts_f32(const MoeExperts *m, const float *x, int64_t rows, const float *logits, float *out,
                    int num_threads) {
    if (!moe_is_valid(m)) return 3;
    float *scratch = malloc(sizeof(float) * (size_t)moe_scratch_floats(m, rows));
    if (scratch == NULL) return 1;
    const int64_t failures = kernel_failures();
#pragma omp parallel num_threads(num_threads)
    phase_moe(m, x, rows, logits, NULL, NULL, out, scratch);
    free(scratch);
    return kernel_failures() != failures ? 1 : 0;
}
