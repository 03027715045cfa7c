#!/usr/bin/env bash
# guidellm (vLLM's load generator) against `nanovllm serve` on the default model, offline: a bounded
# run of streamed chat requests with synthetic prompts; fails unless every request succeeded.
#
#   scripts/check_guidellm.sh [PORT]   (env: PYTHON, GUIDELLM_VENV, GUIDELLM, REQUESTS, STREAMS, DATA, MODEL)
#
# guidellm pins click below the project venv's version and brings uvloop/httptools (which uvicorn
# would then pick up), so it lives in its own venv layered over PYTHON's packages (torch and
# transformers shared): made on first use in GUIDELLM_VENV (default: the nanovllm cache).
set -euo pipefail
cd "$(dirname "$0")/.."

PORT=${1:-8437}
PYTHON=${PYTHON:-$(command -v python)}
GUIDELLM_VENV=${GUIDELLM_VENV:-${NANOVLLM_CACHE:-$HOME/.cache/nanovllm}/guidellm-venv}
GUIDELLM=${GUIDELLM:-$GUIDELLM_VENV/bin/guidellm}
if [ ! -x "$GUIDELLM" ]; then
    echo "installing guidellm into $GUIDELLM_VENV (once)"
    "$PYTHON" -m venv "$GUIDELLM_VENV"
    # A .pth after the venv's own site-packages: guidellm's pins win, the rest comes from PYTHON's.
    "$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
        > "$("$GUIDELLM_VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_base.pth"
    "$GUIDELLM_VENV/bin/pip" install -q "guidellm>=0.8"
fi
REQUESTS=${REQUESTS:-40}
STREAMS=${STREAMS:-4}
DATA=${DATA:-prompt_tokens=64,output_tokens=32}
MODEL=${MODEL:-$("$PYTHON" -c "from nanovllm.utils.default_model import default_model_path; print(default_model_path())")}
NAME=default-model
OUT=$(mktemp -d)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_WAIT_POLICY=PASSIVE

"$PYTHON" -m nanovllm.cli serve "$MODEL" --port "$PORT" --served-model-name "$NAME" --log-level warning \
    > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 $SERVER 2>/dev/null || { cat "$OUT/server.log"; exit 1; }
    sleep 1
done

# Streaming chat completions (guidellm's default request format) with usage in every chunk.
"$GUIDELLM" run \
    --backend "kind=openai_http,target=http://127.0.0.1:$PORT,model=$NAME,stream=true" \
    --tokenizer "kind=huggingface_auto,model=$MODEL" \
    --data "kind=synthetic_text,$DATA" \
    --profile "kind=concurrent,streams=$STREAMS" \
    --constraint "kind=max_requests,count=$REQUESTS" \
    --output "kind=json,path=$OUT/report.json" --output kind=console \
    --disable-progress

# Every request must have succeeded: count them in the report (guidellm's summary shows the same).
"$PYTHON" - "$OUT/report.json" "$REQUESTS" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
totals = report["benchmarks"][0]["metrics"]["request_totals"]
print(f"guidellm requests: {totals}")
if totals.get("errored") or totals.get("incomplete") or totals.get("successful") != int(sys.argv[2]):
    sys.exit(f"FAILED: not every one of {sys.argv[2]} requests succeeded")
print(f"OK: {totals['successful']} / {sys.argv[2]} requests succeeded")
EOF
