#!/usr/bin/env bash
# GPU check, for a machine with a CUDA GPU, torch, triton and transformers (flash-attn optional, no
# network): runs the GPU tests (marker `gpu`, plus the Triton store, fp8 attention, fused-experts and graph-logic tests, on CUDA),
# then a short throughput bench, and prints one table. Finishes within 10 minutes.
#   usage: scripts/gpu_check.sh            (PYTHON=/path/to/python to pick the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 1
if $PY -c "import pytest" 2>/dev/null; then
    echo "running GPU tests (log: pytest tail below)"
    timeout 330 $PY -m pytest -q -p no:cacheprovider --junitxml="$work/junit.xml" \
        tests/engine/test_gpu.py tests/kernels/test_store_kvcache.py tests/engine/test_cuda_graph.py tests/kernels/test_fused_moe.py \
        "tests/kernels/test_triton_attention.py::test_decode_reads_fp8_caches" "tests/kernels/test_triton_attention.py::test_prefill_over_fp8_caches" \
        tests/kernels/test_triton_weight_only.py tests/kernels/test_triton_deltanet.py tests/kernels/test_triton_lora.py "tests/models/test_prequantized.py::test_on_a_gpu_the_triton_kernels_run_the_checkpoints" \
        "tests/spec_decode/test_spec_engine.py::test_cuda_verification_with_and_without_graphs" \
        "tests/kernels/test_sliding_window.py::test_triton_kernels" "tests/kernels/test_sliding_window.py::test_attention_sinks" \
        >"$work/pytest.log" 2>&1
    tests_rc=$?
    tail -n 25 "$work/pytest.log"
    [ $tests_rc -eq 124 ] && echo "pytest stopped by its 330 s timeout"
else
    echo "pytest is not installed: GPU tests not run (pip install pytest)"
    tests_rc=1
fi

timeout 240 $PY scripts/gpu_bench.py --junit "$work/junit.xml" \
    --num-seqs 64 --max-input-len 512 --max-output-len 256
bench_rc=$?
[ $bench_rc -eq 124 ] && echo "bench stopped by its 240 s timeout"
exit $(( tests_rc != 0 || bench_rc != 0 ))
