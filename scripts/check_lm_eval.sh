#!/usr/bin/env bash
# lm-eval against `nanovllm serve` (local-completions: loglikelihood through echo + prompt logprobs,
# and generate_until) and against HF transformers on the same folder, fp32 and greedy: the two score
# tables should be equal. Offline; the tasks are scripts/lm_eval_tasks/ (local JSON data).
#
#   scripts/check_lm_eval.sh [MODEL_FOLDER] [LIMIT]    (needs the `evals` extra: pip install -e .[evals])
set -euo pipefail  # a failed lm_eval run ends the script (pipefail: through tee too)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
MODEL=${1:-$("$PY" -c "from nanovllm.utils.default_model import default_model_path; print(default_model_path())")}
LIMIT=${2:-40}
PORT=${PORT:-8765}
TASKS=nanovllm_capitals_gen,nanovllm_capitals_mc
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
LOG=$(mktemp -d)
COMMON=(--tasks "$TASKS" --include_path scripts/lm_eval_tasks --limit "$LIMIT" --batch_size 1 --log_samples)

"$PY" -m nanovllm.cli serve "$MODEL" --port "$PORT" --dtype float32 --log-level warning >"$LOG/server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$LOG/server.log"; exit 1; }
    sleep 1
done

echo "== nanovllm serve (local-completions) =="
"$PY" -m lm_eval run --model local-completions "${COMMON[@]}" --output_path "$LOG/server" \
    --model_args "model=$MODEL,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$MODEL,tokenizer_backend=huggingface,num_concurrent=1,max_retries=1" \
    2>"$LOG/lm_eval_server.log" | tee "$LOG/server_scores.txt" || { tail -20 "$LOG/lm_eval_server.log"; exit 1; }

echo "== HF transformers (hf) =="
"$PY" -m lm_eval run --model hf "${COMMON[@]}" --output_path "$LOG/hf" --device cpu --model_args "pretrained=$MODEL,dtype=float32" \
    2>"$LOG/lm_eval_hf.log" | tee "$LOG/hf_scores.txt" || { tail -20 "$LOG/lm_eval_hf.log"; exit 1; }

# The score rows (task, filter, metric, value) of both tables must match, and so must every answer:
# the generated texts, and each choice's loglikelihood (to 1e-3).
rows() { grep -E '^\|.*(exact_match|acc)' "$1" | awk -F'|' '{print $2,$4,$6,$8}' | sed 's/  */ /g'; }
[ -n "$(rows "$LOG/hf_scores.txt")" ] || { echo "no score rows found (logs in $LOG)"; exit 1; }
diff <(rows "$LOG/server_scores.txt") <(rows "$LOG/hf_scores.txt") || { echo "MISMATCH: scores (logs in $LOG)"; exit 1; }
"$PY" scripts/compare_lm_eval_samples.py "$LOG/server" "$LOG/hf" || { echo "MISMATCH: answers (logs in $LOG)"; exit 1; }
echo "OK: the scores are equal"
