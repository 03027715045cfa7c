#!/usr/bin/env bash
# Schemathesis against `nanovllm serve` on a tiny random checkpoint, from the server's own
# /openapi.json: every check but positive_data_acceptance (why: tests/server/test_schemathesis.py), then a
# pass with --api-key for ignored_auth. Prints schemathesis' summaries; exits non-zero on a finding.
#
#   scripts/check_schemathesis.sh [MAX_EXAMPLES] [PORT]     (env: PYTHON, SCHEMATHESIS)
set -euo pipefail
cd "$(dirname "$0")/.."

MAX_EXAMPLES=${1:-100}
PORT=${2:-8438}
PYTHON=${PYTHON:-$(command -v python)}
SCHEMATHESIS=${SCHEMATHESIS:-$(dirname "$PYTHON")/schemathesis}
DIR=$(mktemp -d)
MODEL_NAME=tiny-qwen3
export OMP_WAIT_POLICY=PASSIVE SCHEMATHESIS_HOOKS=schemathesis_hooks NANOVLLM_SERVED_MODEL=$MODEL_NAME
export PYTHONPATH="$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"

"$PYTHON" -c "import sys; from helpers import make_qwen3; make_qwen3(sys.argv[1], seed=1)" "$DIR/model" 2>/dev/null

serve() {  # serve [extra flags]: a small context and small limits keep every generation short
    "$PYTHON" -m nanovllm.cli serve "$DIR/model" --port "$PORT" --served-model-name $MODEL_NAME \
        --max-model-len 128 --max-n 4 --max-prompts 8 --kvcache-block-size 16 \
        --cpu-kvcache-bytes 2097152 --log-level warning "$@" >> "$DIR/server.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 120); do
        curl -s "http://127.0.0.1:$PORT/health" > /dev/null && return 0
        kill -0 $SERVER 2>/dev/null || { cat "$DIR/server.log"; exit 1; }
        sleep 0.5
    done
    echo "server did not start"; exit 1
}
stop() { kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true; }
trap stop EXIT

run() {  # run [schemathesis options]
    (cd "$DIR" && "$SCHEMATHESIS" run "http://127.0.0.1:$PORT/openapi.json" --max-examples "$MAX_EXAMPLES" --seed 1 \
        --workers 1 --request-timeout 60 --continue-on-failure --no-color "$@")  # its cache goes to cwd
}

status=0
serve
run --checks all --exclude-checks positive_data_acceptance,ignored_auth || status=1
stop
serve --api-key sekret
run --checks ignored_auth,not_a_server_error,status_code_conformance -H "Authorization: Bearer sekret" || status=1
exit $status
