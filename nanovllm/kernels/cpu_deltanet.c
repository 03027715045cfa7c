/* The state layers' decode steps. Gated DeltaNet's (layers/gated_deltanet.py): one token of each of B sequences through
 * the causal convolution (with its state), the per-head L2 norms, the gated delta rule on each
 * sequence's d_k x d_v state, read and written in place in its slot, and the gated RMSNorm; a phase
 * of the C one-call decode step (cpu_decode.c) and, as deltanet_decode, a call of its own. The torch step did ~40 small
 * ops per layer and copied every state out of its slot and back (1 MB a head group at Qwen3.5's
 * sizes); here each state is read twice and written once:
 *
 *   pass 1: u = S^T k            (S decayed by exp(g) on the fly)
 *           delta = beta (v - exp(g) u)
 *   pass 2: S <- exp(g) S + k delta^T,  o = S^T q   (o from the updated rows as they are written)
 *
 * LFM2's short convolution (layers/short_conv.py): C * conv(B * x), the conv's state the last K - 1
 * products B * x.
 *
 * Mamba-2 (layers/mamba2.py): the convolution with bias and SiLU over x, B and C, then per head the
 * P x N state decayed by exp(dt A) and added dt x B^T, read by C, plus D x; the norm of y silu(z).
 */
#include "cpu_kernels.h"

#include <math.h>
#include <string.h>

/* y [C] = silu(conv of the K - 1 stored inputs then x), the state shifted by x: conv_state [C, K-1]. */
static void conv_channels(const float *x, const float *w, int64_t K, float *conv_state, int64_t first,
                          int64_t end, float *y) {
    for (int64_t c = first; c < end; c++) {
        float *h = conv_state + c * (K - 1);
        const float *wc = w + c * K;
        float acc = x[c] * wc[K - 1];
        for (int64_t j = 0; j < K - 1; j++) acc += h[j] * wc[j];
        for (int64_t j = 0; j + 1 < K - 1; j++) h[j] = h[j + 1];
        if (K > 1) h[K - 2] = x[c];
        y[c] = acc / (1.0f + sexp(-acc));
    }
}

static void l2_normalize(float *x, int64_t n, float scale) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    const float s = scale / sqrtf(sum + 1e-6f);
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}

/* One value head: S [dk, dv] updated in place, o [dv]. */
static void delta_head(float *S, const float *q, const float *k, const float *v, float decay, float beta,
                       int64_t dk, int64_t dv, float *u, float *o) {
    for (int64_t j = 0; j < dv; j++) u[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        const float ki = k[i];
        const float *row = S + i * dv;
        for (int64_t j = 0; j < dv; j++) u[j] += row[j] * ki;
    }
    for (int64_t j = 0; j < dv; j++) {
        u[j] = beta * (v[j] - decay * u[j]);  /* now delta */
        o[j] = 0.0f;
    }
    for (int64_t i = 0; i < dk; i++) {
        const float ki = k[i], qi = q[i];
        float *row = S + i * dv;
        for (int64_t j = 0; j < dv; j++) {
            const float s = decay * row[j] + ki * u[j];
            row[j] = s;
            o[j] += s * qi;
        }
    }
}

/* o [dv] = rms-normed o times weight times silu(z) (GatedRMSNorm). */
static void gated_norm(float *o, const float *z, const float *weight, float eps, int64_t dv) {
    float sq = 0.0f;
    for (int64_t j = 0; j < dv; j++) sq += o[j] * o[j];
    const float inv = 1.0f / sqrtf(sq / (float)dv + eps);
    for (int64_t j = 0; j < dv; j++) o[j] = weight[j] * (o[j] * inv) * (z[j] / (1.0f + sexp(-z[j])));
}

/* Conv channels per work item: a row's 6144 channels (Qwen3.5) in enough items to share among threads. */
#define CONV_SPAN 256

void phase_deltanet(const DeltaNetLayer *X, const float *proj, int64_t proj_stride, int64_t B, const int64_t *slots,
                    float eps, float *out, float *scratch) {
    const int64_t nk = X->nk, nv = X->nv, dk = X->dk, dv = X->dv, K = X->K;
    const int64_t key_dim = nk * dk, C = 2 * key_dim + nv * dv, per_k = nv / nk;
    const int64_t spans = (C + CONV_SPAN - 1) / CONV_SPAN;
    const float q_scale = 1.0f / sqrtf((float)dk);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < B * spans; item++) {
        const int64_t b = item / spans, first = (item % spans) * CONV_SPAN;
        conv_channels(proj + b * proj_stride, X->conv_w, K, X->conv_state + slots[b] * C * (K - 1), first,
                      first + CONV_SPAN < C ? first + CONV_SPAN : C, scratch + b * C);
    }
#pragma omp for schedule(static)
    for (int64_t item = 0; item < B * 2 * nk; item++) {  /* each q and k head */
        const int64_t b = item / (2 * nk), head = item % (2 * nk);
        l2_normalize(scratch + b * C + head * dk, dk, head < nk ? q_scale : 1.0f);
    }
    float u[dv];
#pragma omp for schedule(static)
    for (int64_t item = 0; item < B * nv; item++) {
        const int64_t b = item / nv, h = item % nv, kh = X->tiled ? h % nk : h / per_k;
        const float *y = scratch + b * C, *row = proj + b * proj_stride;
        const float *z = row + C + h * dv, b_logit = row[C + nv * dv + h], a = row[C + nv * dv + nv + h] + X->dt_bias[h];
        /* beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias), softplus linear past 20 as torch's */
        const float beta = 1.0f / (1.0f + expf(-b_logit));
        const float g = -expf(X->A_log[h]) * (a > 20.0f ? a : log1pf(expf(a)));
        float *o = out + (b * nv + h) * dv;
        delta_head(X->state + (slots[b] * nv + h) * dk * dv, y + kh * dk, y + key_dim + kh * dk, y + 2 * key_dim + h * dv,
                   expf(g), beta, dk, dv, u, o);
        gated_norm(o, z, X->norm, eps, dv);
    }
}

/* phase_deltanet as one call (the eager forward's decode steps: the layer's in_proj and out_proj
 * in torch around it). Returns 0. */
int deltanet_decode(const DeltaNetLayer *X, const float *proj, int64_t proj_stride, int64_t B, const int64_t *slots,
                    float eps, float *out, float *scratch, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    phase_deltanet(X, proj, proj_stride, B, slots, eps, out, scratch);
    return 0;
}

/* Channels per work item of the short convolution: a row's 2048 channels (LFM2-1.2B) in 8 items. */
#define SHORT_CONV_SPAN 256

void phase_short_conv(const ShortConvLayer *X, const float *proj, int64_t B, const int64_t *slots, float *out) {
    const int64_t C = X->C, K = X->K, spans = (C + SHORT_CONV_SPAN - 1) / SHORT_CONV_SPAN;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < B * spans; item++) {
        const int64_t b = item / spans, first = (item % spans) * SHORT_CONV_SPAN;
        const int64_t end = first + SHORT_CONV_SPAN < C ? first + SHORT_CONV_SPAN : C;
        const float *gate_b = proj + b * 3 * C, *gate_c = gate_b + C, *x = gate_c + C;
        float *state = X->conv_state + slots[b] * C * (K - 1), *y = out + b * C;
        for (int64_t c = first; c < end; c++) {
            float *h = state + c * (K - 1);
            const float *w = X->conv_w + c * K, bx = gate_b[c] * x[c];
            float acc = (X->conv_bias != NULL ? X->conv_bias[c] : 0.0f) + bx * w[K - 1];
            for (int64_t j = 0; j < K - 1; j++) acc += h[j] * w[j];
            for (int64_t j = 0; j + 1 < K - 1; j++) h[j] = h[j + 1];
            h[K - 2] = bx;
            y[c] = gate_c[c] * acc;
        }
    }
}

/* Mamba-2 channels per work item of the convolution. */
#define MAMBA2_CONV_SPAN 256

void phase_mamba2(const Mamba2Layer *X, const float *rows, int64_t stride, int64_t B, const int64_t *slots, float eps,
                  float *out, float *scratch) {
    const int64_t H = X->heads, P = X->p, N = X->n, G = X->groups, K = X->K, inner = H * P;
    const int64_t C = inner + 2 * G * N, spans = (C + MAMBA2_CONV_SPAN - 1) / MAMBA2_CONV_SPAN;
    const int64_t norm_groups = inner / X->norm_width;
    /* channel c of the conv: x (row offset inner + c) for c < inner, then B and C (after dt) */
#pragma omp for schedule(static)
    for (int64_t item = 0; item < B * spans; item++) {
        const int64_t b = item / spans, first = (item % spans) * MAMBA2_CONV_SPAN;
        const int64_t end = first + MAMBA2_CONV_SPAN < C ? first + MAMBA2_CONV_SPAN : C;
        const float *row = rows + b * stride;
        float *state = X->conv_state + slots[b] * C * (K - 1), *y = scratch + b * C;
        for (int64_t c = first; c < end; c++) {
            const float xc = c < inner ? row[inner + c] : row[2 * inner + H + (c - inner)];
            float *h = state + c * (K - 1);
            const float *w = X->conv_w + c * K;
            float acc = X->conv_b[c] + xc * w[K - 1];
            for (int64_t j = 0; j < K - 1; j++) acc += h[j] * w[j];
            for (int64_t j = 0; j + 1 < K - 1; j++) h[j] = h[j + 1];
            h[K - 2] = xc;
            y[c] = acc / (1.0f + sexp(-acc));
        }
    }
#pragma omp for schedule(static)
    for (int64_t item = 0; item < B * H; item++) {
        const int64_t b = item / H, h = item % H, g = h / X->heads_per_group;
        const float *conv = scratch + b * C, *xh = conv + h * P, *Bg = conv + inner + g * N;
        const float *Cg = conv + inner + G * N + g * N;
        /* dt = clamp(softplus(dt + dt_bias)), softplus linear past 20 as torch's */
        const float raw = rows[b * stride + 2 * inner + h] + X->dt_bias[h];
        float dt = raw > 20.0f ? raw : log1pf(expf(raw));
        dt = dt < X->dt_min ? X->dt_min : dt > X->dt_max ? X->dt_max : dt;
        const float decay = expf(-dt * expf(X->A_log[h])), d = X->D[h];
        float *S = X->ssm + (slots[b] * H + h) * P * N, *o = out + b * inner + h * P;
        for (int64_t p = 0; p < P; p++) {  /* a row of the state: decayed, added u B, read by C */
            float *srow = S + p * N;
            const float u = dt * xh[p];
            vf acc8 = {0};
            int64_t n = 0;
            for (; n + VL <= N; n += VL) {
                const vf v = decay * load_f32(srow + n) + u * load_f32(Bg + n);
                store_f32(srow + n, v);
                acc8 += v * load_f32(Cg + n);
            }
            float acc = hsum(acc8);
            for (; n < N; n++) {
                const float v = decay * srow[n] + u * Bg[n];
                srow[n] = v;
                acc += v * Cg[n];
            }
            o[p] = acc + d * xh[p];
        }
    }
#pragma omp for schedule(static)
    for (int64_t item = 0; item < B * norm_groups; item++) {
        const int64_t b = item / norm_groups, first = (item % norm_groups) * X->norm_width;
        float *o = out + b * inner + first;
        const float *z = rows + b * stride + first;
        const int gate_first = X->norm != NULL && !X->norm_before_gate;
        float sq = 0.0f;
        for (int64_t j = 0; j < X->norm_width; j++) {
            if (gate_first || X->norm == NULL) o[j] *= z[j] / (1.0f + sexp(-z[j]));
            sq += o[j] * o[j];
        }
        if (X->norm == NULL) continue;
        const float inv = 1.0f / sqrtf(sq / (float)X->norm_width + eps);
        for (int64_t j = 0; j < X->norm_width; j++)
            o[j] *= inv * X->norm[first + j] * (gate_first ? 1.0f : z[j] / (1.0f + sexp(-z[j])));
    }
}

int mamba2_decode(const Mamba2Layer *X, const float *rows, int64_t stride, int64_t B, const int64_t *slots, float eps,
                  float *out, float *scratch, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    phase_mamba2(X, rows, stride, B, slots, eps, out, scratch);
    return 0;
}
