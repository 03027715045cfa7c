#!/usr/bin/env bash
# The virtual environment llm-compressor runs in (scripts/llmcompressor_quantize.py): llm-compressor
# pins a transformers older than the project's, so it gets its own venv, layered over PYTHON's
# packages (torch shared, not installed twice). Made once; prints the venv's python.
#
#   scripts/llmcompressor_env.sh   (env: PYTHON, LLMCOMPRESSOR_VENV)
set -euo pipefail
PYTHON=${PYTHON:-$(command -v python)}
VENV=${LLMCOMPRESSOR_VENV:-${NANOVLLM_CACHE:-$HOME/.cache/nanovllm}/llmcompressor-venv}
if ! "$VENV/bin/python" -c "import llmcompressor" 2> /dev/null; then
    echo "installing llm-compressor into $VENV (once)" >&2
    "$PYTHON" -m venv "$VENV"
    # A .pth after the venv's own site-packages: llm-compressor's pins win, the rest comes from PYTHON's.
    "$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
        > "$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_base.pth"
    "$VENV/bin/pip" install -q "llmcompressor==0.14.0.1" >&2
fi
echo "$VENV/bin/python"
