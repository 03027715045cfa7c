/* Shared declarations of the CPU kernels (cpu_kernels.c: attention and linear layers;
 * cpu_decode.c: the whole decode step). All activations are fp32; weights fp32 or bf16. */
#ifndef NANOVLLM_CPU_KERNELS_H
#define NANOVLLM_CPU_KERNELS_H

#include <stdint.h>
#include <string.h>

#include "isa.h"

/* Bumped whenever a structure below or an exported signature changes: kernels/cpu_kernels.py
 * refuses a library whose version or structure sizes differ from its own. */
#define NANOVLLM_ABI_VERSION 23

/* A weight matrix as the kernels stream it: n rows of row_bytes bytes, each holding k weights in
 * the format weight_types[type] describes, plus that format's side data (scales; NULL for dense
 * types). y = x W^T (+ bias). */
typedef struct Linear {
    const void *data;
    const float *bias;   /* [n] or NULL */
    const void *scales;
    int64_t n, k;
    int64_t type;        /* index into weight_types[] */
    int64_t row_bytes;
    /* The outputs after these n come from another matrix of the same k (a stacked layer whose
     * parts are stored in different formats, e.g. Q4_K q/k and Q6_K v), or NULL. */
    const struct Linear *next;
    /* The block formats' inputs, rounded per group: 1, to int8 (llama.cpp's arithmetic: the
     * interleaved kernels do half the integer work); 2, to 14 bits in two int8 planes; anything
     * else, to int8 where that is within 40 dB of the group's signal and to 14 bits elsewhere. */
    int64_t input_planes;
} Linear;

/* y[b, r] = W[r, :] . x[b, :] (+ bias[r]) for b < rows and every weight row r, as an orphaned `omp
 * for nowait` over the rows (see linear_rows_for, which adds the barrier). One per format, generated from the format's row dot
 * product (DEFINE_LINEAR_ROWS in cpu_kernels.c), so the dot is inlined in the row loop. */
typedef void (*LinearRows)(const Linear *m, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy);
/* out[0, k) = W[r, :] as fp32 (embedding lookups). */
typedef void (*RowToF32)(const Linear *m, int64_t r, float *out);

/* One row per weight format (ggml's type_traits), generated from WEIGHT_FORMATS below. */
typedef struct {
    const char *name;
    int64_t block_size;  /* weights per block */
    int64_t block_bytes; /* bytes per block (and row) */
    int64_t group_rows;  /* rows stored together (interleaved formats: 8); n must be a multiple */
    LinearRows linear_rows;
    RowToF32 row_to_f32;
} WeightType;

extern const WeightType weight_types[];
extern const int64_t num_weight_types;
int64_t weight_type_index(const char *name); /* the row of a format's name, or -1 */
/* 1 where a format can be multiplied now (the i-quants: once their grid is installed, set_quant_grid) */
int64_t weight_type_ready(const char *type_name);

/* THE table of weight formats, one row each: name (GGUF's type name in lower case; "x8": the plain
 * format interleaved by 8 rows at load, repack_x8), weights per block, bytes per block, rows stored
 * together. weight_types[] (cpu_kernels.c) and the declarations below are generated from it. A new
 * block format is a row here, its row loop and row-to-fp32 (linear_rows_NAME, to_f32_NAME in
 * cpu_quant.c) and its row in layers/quantization/block_formats.py (a test compares the two tables). */
#define WEIGHT_FORMATS(X)                                                                                          \
    X(f32, 1, 4, 1) X(bf16, 1, 2, 1) X(f16, 1, 2, 1)                                                           \
    X(q8_0, 32, 34, 1) X(q4_0, 32, 18, 1) X(q4_1, 32, 20, 1) X(q5_0, 32, 22, 1) X(q5_1, 32, 24, 1)            \
    X(q4_k, 256, 144, 1) X(q6_k, 256, 210, 1)                                                                  \
    /* fp8 checkpoints' weights: an fp32 scale, then 32 float8_e4m3fn (layers/quantization/weight_only.py) */  \
    X(e4m3, 32, 36, 1)                                                                                         \
    X(q8_0x8, 32, 34, 8) X(q4_0x8, 32, 18, 8) X(q4_1x8, 32, 20, 8) X(q5_0x8, 32, 22, 8) X(q5_1x8, 32, 24, 8)  \
    X(q4_kx8, 256, 144, 8) X(q6_kx8, 256, 210, 8)                                                              \
    /* OCP microscaling FP4 (GPT-OSS's experts): an E8M0 exponent, then 32 E2M1 nibbles */                      \
    X(mxfp4, 32, 17, 1) X(mxfp4x8, 32, 17, 8)                                                                  \
    /* multiplied through a decoded block (cpu_quant_decoded.h) */                                             \
    X(q2_k, 256, 84, 1) X(q3_k, 256, 110, 1) X(q5_k, 256, 176, 1) X(iq4_nl, 32, 18, 1) X(iq4_xs, 256, 136, 1)  \
    X(iq2_xxs, 256, 66, 1) X(iq2_xs, 256, 74, 1) X(iq2_s, 256, 82, 1) X(iq3_xxs, 256, 98, 1)                   \
    X(iq3_s, 256, 110, 1) X(iq1_s, 256, 50, 1) X(iq1_m, 256, 56, 1)
#define DECLARE_FORMAT(NAME, BLOCK_SIZE, BLOCK_BYTES, GROUP_ROWS)                                                  \
    void linear_rows_##NAME(const Linear *m, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy); \
    void to_f32_##NAME(const Linear *m, int64_t r, float *out);
WEIGHT_FORMATS(DECLARE_FORMAT)
#undef DECLARE_FORMAT

/* Whether m's type is a row of weight_types and its rows are laid out as that type says (and so
 * every matrix chained after it, each of the same k). */
int linear_is_valid(const Linear *m);

/* The outputs of m and every matrix chained after it. */
int64_t linear_outputs(const Linear *m);

/* y[r, :] = W x[r, :] (+ bias) for rows r < rows (x row stride ldx, y row stride ldy), W's
 * chained matrices writing the outputs after its own.
 * An orphaned `omp for` over W's rows: inside a parallel region the threads share the work;
 * outside one it runs on the calling thread. One barrier at the end of the chain. */
/* A row loop that cannot allocate its scratch (the quantized inputs) skips its share and counts
 * the failure here; an entry point compares the count before and after its parallel region and
 * returns an error code (a MemoryError in Python) instead of ending the process. */
void note_kernel_failure(void);
int64_t kernel_failures(void);

void linear_rows_for(const Linear *m, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy);
/* The same without the barrier: the matrices of independent products (a step's experts) run back
 * to back, each thread going on to its share of the next; the caller puts a barrier before reading y. */
void linear_rows_nowait(const Linear *m, const float *x, int64_t ldx, int64_t rows, float *y, int64_t ldy);

/* ---- the KV cache (cpu_attention.c) ------------------------------------------------------------
 * The formats a cached K or V row of one head is stored in, in the order of KV_FORMATS in
 * layers/backends/kv_formats.py (which states each one): fp32, bf16, f16, int8 (llama.cpp's q8_0
 * blocks: an fp16 scale and 32 int8 per 32 values), float8 e4m3fn and e5m2. A paged cache is
 * [num_blocks, block_size, num_kv_heads, kv_row_bytes(type, head_dim)] bytes. */
enum { KV_F32, KV_BF16, KV_F16, KV_Q8_0, KV_E4M3, KV_E5M2, KV_NUM_TYPES };
int64_t kv_row_bytes(int64_t kv_type, int64_t head_dim); /* 0 for an unknown type or a bad head_dim */
/* dst = the row x[0, head_dim) in the format (rounded as the Python reference rounds it). */
void kv_store_row(int64_t kv_type, void *dst, const float *x, int64_t head_dim);

/* How a decode step's attention is cut into work items (decode_plan, cpu_attention.c): items of
 * kv_heads_per_item KV heads of one sequence over `chunk` of its tokens (a multiple of the block
 * size); splits = chunks per sequence (1: whole sequences, each item's output final; more: each
 * chunk's partial softmax goes to a shared buffer and is merged). */
typedef struct {
    int64_t kv_heads_per_item, chunk, splits;
} DecodePlan;
DecodePlan decode_plan(int64_t num_seqs, int64_t num_kv_heads, int64_t max_context, int64_t block_size,
                       int num_threads);
int64_t decode_scratch_floats(const DecodePlan *p, int64_t group); /* per thread */
int64_t decode_partial_floats(const DecodePlan *p, int64_t num_seqs, int64_t num_heads, int64_t head_dim); /* shared */
/* Called by an item before it reads sequence b's KV heads [kv_first, kv_end) (whole-sequence plans
 * only): the C decode step rotates and stores the new token's heads there. */
typedef void (*ItemPrepare)(const void *ctx, int64_t b, int64_t kv_first, int64_t kv_end);
/* Orphaned worksharing loops: out (row b at b * out_stride) = the attention of each sequence's query
 * (q row b at b * q_stride, [num_heads, head_dim]) over its context_lens[b] cached tokens, in the
 * plan's items. scratch: this thread's decode_scratch_floats (NULL: its items are skipped, the
 * caller reports it); parts: the shared decode_partial_floats. window > 0: each query sees its
 * sequence's last `window` tokens only (sliding-window attention; the plan made for at most
 * window + block_size tokens). softcap > 0: scaled scores capped by softcap * tanh(s / softcap).
 * sinks (NULL: none): [num_heads] logits that join each head's softmax denominator (GPT-OSS). */
void phase_decode_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                            int64_t kv_type, const int32_t *block_tables, int64_t max_blocks,
                            const int32_t *context_lens, float *out, int64_t out_stride, int64_t num_seqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            float scale, int64_t window, float softcap, const float *sinks, const DecodePlan *p,
                            float *scratch, float *parts, ItemPrepare prepare, const void *ctx);

/* ---- a mixture-of-experts layer's experts (cpu_moe.c) ------------------------------------------ */
typedef struct {
    const Linear *gate_up;  /* [num_experts]: expert e's [2 intermediate, hidden], gate rows then up rows */
    const Linear *down;     /* [num_experts]: expert e's [hidden, intermediate] */
    int64_t num_experts, top_k, renormalize, hidden, intermediate;
    Linear router;          /* [num_experts, hidden]; data NULL: the logits come from outside */
    /* The shared expert (shared_down data NULL: none), added with weight sigmoid(shared_gate x)
     * (Qwen2-MoE), or 1 where shared_gate's data is NULL (GLM-4.5, DeepSeek-V3). */
    Linear shared_gate_up, shared_down, shared_gate;
    /* The experts' activation of gate g and up u: MOE_SILU silu(g) u; MOE_SWIGLU_OAI (GPT-OSS)
     * (clamp(u, -limit, limit) + 1) g' sigmoid(alpha g') with g' = min(g, limit). (The experts'
     * biases, where a model has them, are their Linears' own.) */
    int64_t activation;
    float alpha, limit;
    /* The router's rule: n_group 0, the softmax top-k (renormalized over the chosen when asked);
     * n_group > 0, DeepSeek-V3 / GLM-4.5's (layers/quantization/moe_ops.py GroupedTopK): scores
     * sigmoid(logit), experts chosen by score + correction_bias[e] among the topk_group groups of
     * num_experts / n_group whose two best biased scores sum highest, weights the chosen scores
     * (renormalized when asked) times routed_scale. */
    int64_t n_group, topk_group;
    const float *correction_bias; /* [num_experts] fp32 */
    float routed_scale;
} MoeExperts;
enum { MOE_SILU, MOE_SWIGLU_OAI };

int moe_is_valid(const MoeExperts *m);
/* Floats of scratch phase_moe needs for B rows. */
int64_t moe_scratch_floats(const MoeExperts *m, int64_t B);
/* Orphaned worksharing loops: out [B, hidden] = the routed experts of x (+ sigmoid(shared_gate) *
 * shared where shared != NULL), routed by logits [B, num_experts]. */
void phase_moe(const MoeExperts *m, const float *x, int64_t B, const float *logits, const float *shared,
               const float *shared_gate, float *out, float *scratch);

/* ---- Gated DeltaNet's decode step (cpu_deltanet.c) ---------------------------------------------- */
/* A linear-attention layer as the C decode step runs it (layers/gated_deltanet.py): its in_proj
 * (the layer's qkv Linear) gives each row [q k v channels C | z (nv dv) | b (nv) | a (nv)], C =
 * 2 nk dk + nv dv; its out_proj is the layer's o Linear. */
typedef struct {
    const float *conv_w;            /* [C, K] */
    float *conv_state;              /* [slots, C, K - 1]: the last K - 1 inputs of each sequence */
    float *state;                   /* [slots, nv, dk, dv]: each sequence's delta-rule state, fp32 */
    const float *A_log, *dt_bias;   /* [nv] */
    const float *norm;              /* [dv]: the gated RMSNorm's weight */
    int64_t nk, nv, dk, dv, K;
    int64_t tiled;                  /* 1: value head h uses key head h mod nk (llama.cpp's files), else h / (nv / nk) */
} DeltaNetLayer;
/* Orphaned worksharing loops: out [B, nv dv] = the gated-normed delta-rule outputs of proj [B,
 * proj_stride] (one token of each sequence, state slot slots[b]), the states updated in place.
 * scratch: B * C floats, shared. */
void phase_deltanet(const DeltaNetLayer *X, const float *proj, int64_t proj_stride, int64_t B, const int64_t *slots,
                    float eps, float *out, float *scratch);
/* phase_deltanet in a parallel region of its own. Returns 0. */
int deltanet_decode(const DeltaNetLayer *X, const float *proj, int64_t proj_stride, int64_t B, const int64_t *slots,
                    float eps, float *out, float *scratch, int num_threads);

/* ---- LFM2's short convolution in the decode step (cpu_deltanet.c) ------------------------------ */
/* A short-convolution layer (layers/short_conv.py): its in_proj (the layer's qkv Linear) gives each
 * row [B | C | x] of C channels each; out_proj is the layer's o Linear. */
typedef struct {
    const float *conv_w;    /* [C, K] */
    const float *conv_bias; /* [C], or NULL */
    float *conv_state;      /* [slots, C, K - 1]: each sequence's last K - 1 products B * x */
    int64_t C, K;
} ShortConvLayer;
/* Orphaned worksharing loop: out [B, C] = C * conv(B * x) of proj [B, 3 C] (one token of each
 * sequence, state slot slots[b]), the states shifted in place. */
void phase_short_conv(const ShortConvLayer *X, const float *proj, int64_t B, const int64_t *slots, float *out);

/* ---- Mamba-2's decode step (cpu_deltanet.c) ----------------------------------------------------- */
/* A Mamba-2 mixer (layers/mamba2.py): proj, its in_proj with bc_proj chained after it, gives each row
 * [z (heads P) | x (heads P) | dt (heads) | B (groups N) | C (groups N)]; the conv runs over x, B and
 * C (C_ch = heads P + 2 groups N channels); out is its out_proj. */
typedef struct {
    Linear proj, out;               /* data NULL: not described (the mixer's own call, mamba2_decode) */
    const float *conv_w, *conv_b;   /* [C_ch, K], [C_ch] */
    float *conv_state;              /* [slots, C_ch, K - 1]: the last K - 1 inputs of each sequence */
    float *ssm;                     /* [slots, heads, P, N]: each sequence's state, fp32 */
    const float *A_log, *D, *dt_bias; /* [heads] */
    const float *norm;              /* [heads P]: the gated RMSNorm's weight; NULL: no norm, y silu(z) */
    int64_t heads, p, n, groups, heads_per_group, K;
    int64_t norm_width;             /* the channels of each of the norm's groups */
    int64_t norm_before_gate;       /* 1: norm(y) w silu(z) (Falcon-H1's option), 0: norm(y silu(z)) w */
    float dt_min, dt_max;           /* the time step's clamp */
} Mamba2Layer;
/* Orphaned worksharing loops: out [B, heads P] = the gated-normed Mamba-2 outputs of rows [B,
 * stride] (one token of each sequence, state slot slots[b]), the states updated in place; scratch:
 * B * C_ch floats, shared. */
void phase_mamba2(const Mamba2Layer *X, const float *rows, int64_t stride, int64_t B, const int64_t *slots, float eps,
                  float *out, float *scratch);
/* phase_mamba2 in a parallel region of its own. Returns 0. */
int mamba2_decode(const Mamba2Layer *X, const float *rows, int64_t stride, int64_t B, const int64_t *slots, float eps,
                  float *out, float *scratch, int num_threads);

/* ---- LoRA adapters in the decode step (cpu_lora.c) ----------------------------------------------- */
#define LORA_MAX_PARTS 4
/* One matrix's adapter slots (lora/layers.py LoRALayer): A [slots, parts * rank, k] and
 * B^T [slots, rank, n], the scale folded into B, lower ranks zero-padded. Output j belongs to part p,
 * part_ends[p - 1] <= j < part_ends[p] (q | k | v, gate | up), whose A rows are p * rank .. + rank. */
enum { LORA_F32 = 0, LORA_BF16 = 1, LORA_I8 = 2 };
typedef struct {
    const void *a, *b;                  /* fp32, bf16 or int8 (dtype) */
    int64_t k, n, rank, parts, slots;   /* inputs and outputs, as a Linear's */
    int64_t part_ends[LORA_MAX_PARTS];
    int64_t dtype;                      /* LORA_F32, LORA_BF16 or LORA_I8 */
    /* LORA_I8 (else NULL): each row's scale, A's [slots, parts * rank] and B^T's per part
     * [slots, rank, parts] (a value is its int8 times its row's scale) */
    const float *a_scale, *b_scale;
} LoraMatrix;
/* A decode step's adapters: mats [num_layers * 4], each layer's qkv, o, gate_up and down (a NULL:
 * no adapter touches it); row_slots [rows]: each row's slot, < 0 for the base model; width: the
 * widest parts * rank (the shrink's scratch per row). */
typedef struct {
    const LoraMatrix *mats;
    const int64_t *row_slots;
    int64_t width;
} LoraStep;
int lora_matrix_is_valid(const LoraMatrix *W);
/* Orphaned worksharing loops: y [B, ldy] += each slotted row's (x A^T) B^T, x [B, ldx]; t: B * parts
 * * rank floats, shared. Ends in a barrier. */
void phase_lora(const LoraMatrix *W, const float *x, int64_t ldx, int64_t B, const int64_t *row_slots, float *t,
                float *y, int64_t ldy);
/* phase_lora in a parallel region of its own (the torch forward's steps: prefills, and decode steps
 * the one call does not run). Returns 0, or -1 for a matrix lora_matrix_is_valid refuses. */
int lora_apply(const LoraMatrix *W, const float *x, int64_t ldx, int64_t B, const int64_t *row_slots, float *t,
               float *y, int64_t ldy, int num_threads);

/* ---- the decode step's description (cpu_decode.c) ---------------------------------------------- */
typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    const float *q_norm, *k_norm;        /* [head_dim] each, or NULL (no q/k norm) */
    Linear qkv, o, gate_up, down;        /* qkv: q, k, v rows stacked; gate_up: gate then up rows */
    void *k_cache, *v_cache;             /* paged caches in DecoderModel.kv_type */
    int64_t in_c;                        /* 1: the four matmuls and the gated MLP run here; 0: the layer's
                                          * own module runs them (only its phases are called) */
    const MoeExperts *moe;               /* non-NULL: the MLP is this sparse MoE block (gate_up and down unused) */
    int64_t window;                      /* > 0: sliding-window attention over the last `window` tokens */
    const float *sinks;                  /* [num_heads] logits in each head's softmax denominator, or NULL */
    int64_t kv_group;                    /* the KV group whose block tables it reads: its step is s[kv_group] */
    /* 1: gated attention (Qwen3.5 / Qwen3-Next): qkv's q rows are [q_h | gate_h] per head, and the
     * attention output is multiplied by sigmoid(gate) before o. */
    int64_t attn_gate;
    /* non-NULL: a Gated DeltaNet layer (qkv its in_proj, o its out_proj; no KV cache, no norms of q/k) */
    const DeltaNetLayer *linear;
    int64_t no_rope;                     /* 1: a NoPE layer (SmolLM3's): q and k are not rotated */
    /* non-NULL: a short-convolution layer (LFM2; qkv its in_proj, o its out_proj; no KV cache) */
    const ShortConvLayer *short_conv;
    /* non-NULL: a Mamba-2 mixer (its own proj and out matrices); with qkv / o data, attention runs beside
     * it on the same input and their outputs are summed (Falcon-H1), else it is the layer's mixer */
    const Mamba2Layer *mamba2;
} DecoderLayer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    int64_t kv_type;         /* the KV caches' format (KV_F32 ...) */
    float eps, scale;
    int64_t rotary_dim;      /* the first rotary_dim of each head are rotated (head_dim: all of it) */
    const float *cos_sin;    /* [max_position, rotary_dim]: cos of the rotary_dim / 2 frequencies, then sin */
    const float *final_norm; /* [hidden] */
    const DecoderLayer *layers;
    Linear embed;            /* [vocab, hidden]; data NULL: the lookup runs outside */
    Linear head;             /* [vocab, hidden] (the embedding table itself when tied); data NULL: outside */
    /* Granite's multipliers (1 elsewhere): the embedding rows times embed_scale, each layer's branch
     * outputs times residual_scale as they join the stream, the logits times logit_scale. */
    float embed_scale, residual_scale, logit_scale;
} DecoderModel;

/* One decode step's batch, as the torch decode path gets it: one per KV group (a model whose layers
 * attend in several ways holds a block table per kind, engine/kv_groups.py), alike but for slots,
 * block_tables and max_blocks. */
typedef struct {
    const int64_t *positions, *slots;   /* slots: cache slot of each new token (< 0: not stored) */
    const int32_t *block_tables;        /* [num_seqs, max_blocks] */
    const int32_t *context_lens;        /* the new token included, each <= max_context */
    int64_t num_seqs, max_blocks, max_context;
    /* 1: rows of one sequence (speculative verification: a sequence's last token and its proposals,
     * one row each): a row reads K/V that another row of the step stores, so every row is stored
     * before any attends. */
    int64_t store_first;
    const int64_t *state_slots;         /* [num_seqs]: each sequence's linear-attention state slot (NULL: none) */
} DecodeStep;

/* ---- GCC vector types of VL lanes: one source serves AVX2 and AVX-512 (-march=native) ---------
 * 8 lanes (256 bits) even with AVX-512: 16-lane vectors streamed one weight row slower
 * (docs/performance.md, "The dense C tiles"). */
#define VL 8
typedef float vf __attribute__((vector_size(4 * VL)));
typedef float vf_u __attribute__((vector_size(4 * VL), aligned(4), may_alias)); /* unaligned access */
typedef int32_t vi __attribute__((vector_size(4 * VL)));

static inline vf load_f32(const float *p) { return *(const vf_u *)p; }

static inline void store_f32(float *p, vf v) { *(vf_u *)p = v; }

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

/* Lanes of a where mask is set (all ones), else of b. */
static inline vf vselect(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

/* The range reduction of e^x for lanes x already within [-87, 88]: x = n ln2 + r with n an integer
 * (returned in *n as a float) and |r| <= ln2 / 2 (returned); e^x is then exp_scale(e^r, n). */
static inline vf exp_reduce(vf x, vf *n) {
    /* n = round(x / ln2): adding 1.5 * 2^23 leaves the integer part in the float's last place. */
    *n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    /* r = x - n ln2, ln2 in two parts (Cody-Waite) so that n * hi is exact. */
    return (x - *n * 0.693359375f) - *n * -2.12194440e-4f;
}

/* er 2^n, 2^n through the exponent bits (a normal float for n in [-126, 127]). */
static inline vf exp_scale(vf er, vf n) { return er * (vf)((__builtin_convertvector(n, vi) + 127) << 23); }

/* e^r by its Taylor polynomial of the given degree (at most 7), by Horner's rule. */
static inline vf exp_taylor(vf r, const int degree) {
    static const float c[8] = {1.0f, 1.0f, 0.5f, 1.0f / 6.0f, 1.0f / 24.0f, 1.0f / 120.0f, 1.0f / 720.0f, 1.0f / 5040.0f};
    vf p = (vf){0} + c[degree];
    for (int k = degree - 1; k >= 0; k--) p = p * r + c[k];
    return p;
}

/* e^x of each lane: e^r by its degree-7 Taylor polynomial after exp_reduce (truncation error < 1e-8
 * relative there). Lanes are clamped to [-87, 88], where 2^n stays a normal float: e^-87 ~ 1.6e-38
 * stands in for anything smaller (a softmax numerator next to the max's 1), e^88 for anything larger
 * (SiLU of x < -88 is then x / 1.6e38, not -0). glibc's expf is scalar and took a tenth of the
 * attention time. */
static inline vf vexp(vf x) {
    const vf lo = (vf){0} - 87.0f, hi = (vf){0} + 88.0f;
    x = vselect(x < lo, lo, x);
    x = vselect(x > hi, hi, x);
    vf n;
    const vf r = exp_reduce(x, &n);
    return exp_scale(exp_taylor(r, 7), n);
}

/* A bf16 value as the fp32 it is the top half of. */
static inline float scalar_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

typedef uint16_t vh_u __attribute__((vector_size(2 * VL), aligned(2), may_alias));
typedef uint32_t vu __attribute__((vector_size(4 * VL)));

/* bf16 is the top half of an fp32: widen each lane and shift it into place. One vpmovzxwd does the
 * widening; GCC's generic form of it took four instructions with AVX2, which made the bf16 kernel
 * compute-bound. */
#if ISA_AVX2
static inline vf load_bf16(const uint16_t *p) {
    return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#else
static inline vf load_bf16(const uint16_t *p) { return (vf)(__builtin_convertvector(*(const vh_u *)p, vu) << 16); }
#endif

/* e^x of one float, the same function as vexp's lanes. */
static inline float sexp(float x) { return vexp((vf){0} + x)[0]; }

/* act[i] = silu(g[i]) * u[i] for i in [first, end), VL lanes at a time (vexp: glibc's scalar expf
 * made SiLU a tenth of the step at 64 sequences); the decode step's and the experts' (cpu_decode.c, cpu_moe.c). */
static inline void silu_mul_span(const float *g, const float *u, int64_t first, int64_t end, float *act) {
    int64_t i = first;
    for (; i + VL <= end; i += VL) {
        const vf gv = load_f32(g + i);
        store_f32(act + i, gv / (1.0f + vexp(-gv)) * load_f32(u + i));
    }
    for (; i < end; i++) act[i] = g[i] / (1.0f + sexp(-g[i])) * u[i];
}

#endif
