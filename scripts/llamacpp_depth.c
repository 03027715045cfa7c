/* One sequence's decode behind a long prompt in llama.cpp, with a prefill that can stop and go on.
 *
 * llama-batched-bench prefills its prompt in one process; over a q8_0 cache at 32768 tokens that is
 * hours of two cores, longer than a working session. This program does what batched-bench does for
 * -npp P -ntg N -npl 1 (random tokens, n_batch 2048 / n_ubatch 512, flash attention on, the cache
 * in the type asked for; decode timed as N single-token llama_decode calls, each synchronized), but
 * after every STEP tokens of the prompt it saves the sequence's state (its KV cache and the tokens
 * so far, llama_state_seq_save_file) to STATE, written aside and renamed over it, so a run that is
 * stopped goes on from the last save the next time it is started with the same arguments.
 *
 *   llamacpp_depth MODEL.gguf DEPTH DECODE KV_TYPE(f16|q8_0) THREADS STATE [STEP]
 *
 * Prints progress lines to stderr and, at the end, one JSON line to stdout: the prefill's speed over
 * the tokens this run prefilled (and how many it resumed from), the decode's speed, and the greedy
 * token after the prompt (the same whether the prompt was prefilled in one run or resumed).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

static void quiet(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (level >= GGML_LOG_LEVEL_WARN) fputs(text, stderr);
}

static int argmax(const float *logits, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (logits[i] > logits[best]) best = i;
    return best;
}

/* tokens[start, end) at positions start.., the last one's logits asked for */
static int decode_span(struct llama_context *ctx, struct llama_batch *batch, const llama_token *tokens,
                       int start, int end) {
    batch->n_tokens = end - start;
    for (int i = start; i < end; i++) {
        int j = i - start;
        batch->token[j] = tokens[i];
        batch->pos[j] = i;
        batch->n_seq_id[j] = 1;
        batch->seq_id[j][0] = 0;
        batch->logits[j] = i == end - 1;
    }
    int rc = llama_decode(ctx, *batch);
    llama_synchronize(ctx);
    return rc;
}

int main(int argc, char **argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s MODEL.gguf DEPTH DECODE KV_TYPE(f16|q8_0) THREADS STATE [STEP]\n", argv[0]);
        return 2;
    }
    const char *model_path = argv[1], *state = argv[6];
    int depth = atoi(argv[2]), n_decode = atoi(argv[3]), threads = atoi(argv[5]);
    int step = argc > 7 ? atoi(argv[7]) : 512;
    enum ggml_type kv;
    if (!strcmp(argv[4], "f16")) kv = GGML_TYPE_F16;
    else if (!strcmp(argv[4], "q8_0")) kv = GGML_TYPE_Q8_0;
    else { fprintf(stderr, "KV_TYPE must be f16 or q8_0, got %s\n", argv[4]); return 2; }
    if (depth < 1 || n_decode < 1 || threads < 1 || step < 1) {
        fprintf(stderr, "DEPTH, DECODE, THREADS and STEP must be positive\n");
        return 2;
    }

    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(model_path, mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", model_path); return 1; }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = depth + n_decode + 16;
    cp.n_batch = 2048;
    cp.n_ubatch = 512;
    cp.n_seq_max = 1;
    cp.n_threads = cp.n_threads_batch = threads;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    cp.type_k = cp.type_v = kv;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot make a context of %d tokens\n", (int)cp.n_ctx); return 1; }
    int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    /* the prompt and the decoded tokens: random ids, as batched-bench's, from a fixed seed */
    int total = depth + n_decode;
    llama_token *tokens = malloc(sizeof(llama_token) * (size_t)total);
    uint64_t seed = 0x9E3779B97F4A7C15ull;
    for (int i = 0; i < total; i++) {
        seed ^= seed << 13; seed ^= seed >> 7; seed ^= seed << 17;
        tokens[i] = (llama_token)(seed % (uint64_t)n_vocab);
    }

    int done = 0;
    llama_token *saved = malloc(sizeof(llama_token) * (size_t)total);
    size_t n_saved = 0;
    FILE *probe = fopen(state, "rb");
    if (probe) {
        fclose(probe);
        if (!llama_state_seq_load_file(ctx, state, 0, saved, (size_t)total, &n_saved)) {
            fprintf(stderr, "cannot read the saved state %s (another model or cache type?)\n", state);
            return 1;
        }
        if (n_saved > (size_t)depth || memcmp(saved, tokens, n_saved * sizeof(llama_token))) {
            fprintf(stderr, "%s holds another prompt than this run's; remove it to start over\n", state);
            return 1;
        }
        done = (int)n_saved;
        fprintf(stderr, "resumed from %s: %d of %d prompt tokens already in the cache\n", state, done, depth);
    }
    int resumed = done;

    struct llama_batch batch = llama_batch_init(step, 0, 1);
    char *aside = malloc(strlen(state) + 8);
    sprintf(aside, "%s.part", state);
    double prefill_us = 0;
    int greedy = -1;
    while (done < depth) {
        int end = done + step < depth ? done + step : depth;
        int64_t t0 = llama_time_us();
        if (decode_span(ctx, &batch, tokens, done, end)) { fprintf(stderr, "llama_decode failed at %d\n", done); return 1; }
        prefill_us += (double)(llama_time_us() - t0);
        done = end;
        if (done == depth) greedy = argmax(llama_get_logits_ith(ctx, -1), n_vocab);
        if (!llama_state_seq_save_file(ctx, aside, 0, tokens, (size_t)done) || rename(aside, state)) {
            fprintf(stderr, "cannot save the state to %s\n", state);
            return 1;
        }
        fprintf(stderr, "prefilled %d / %d tokens (%.1f tok/s over this run's %d)\n", done, depth,
                (done - resumed) / (prefill_us / 1e6), done - resumed);
    }
    if (greedy < 0) {  /* the whole prompt came from the state: its last token's logits again */
        llama_memory_seq_rm(llama_get_memory(ctx), 0, depth - 1, -1);
        if (decode_span(ctx, &batch, tokens, depth - 1, depth)) { fprintf(stderr, "llama_decode failed\n"); return 1; }
        greedy = argmax(llama_get_logits_ith(ctx, -1), n_vocab);
    }

    int64_t t0 = llama_time_us();
    for (int i = depth; i < total; i++)
        if (decode_span(ctx, &batch, tokens, i, i + 1)) { fprintf(stderr, "llama_decode failed at %d\n", i); return 1; }
    double decode_s = (double)(llama_time_us() - t0) / 1e6;

    printf("{\"pp\": %d, \"tg\": %d, \"kv\": \"%s\", \"threads\": %d, \"resumed_from\": %d, "
           "\"speed_pp\": %.3f, \"speed_tg\": %.4f, \"greedy_after_prompt\": %d}\n",
           depth, n_decode, argv[4], threads, resumed,
           done > resumed ? (done - resumed) / (prefill_us / 1e6) : 0.0, n_decode / decode_s, greedy);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    free(tokens); free(saved); free(aside);
    return 0;
}
