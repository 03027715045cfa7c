"""Building the C kernels: once per cache key, whoever asks at the same time (TP workers, two
engines), and said to the user while it happens."""
import logging
import threading
import time

from nanovllm.kernels import cpu_kernels


def test_one_build_per_cache_key_under_a_lock(tmp_path, monkeypatch, caplog):
    calls = []

    def slow_build(path):
        calls.append(path)
        time.sleep(0.3)  # long enough for the other callers to be waiting on the lock
        path.write_bytes(b"library")

    monkeypatch.setattr(cpu_kernels, "build", slow_build)
    target = tmp_path / "kernels" / "cpu_kernels-key.so"
    with caplog.at_level(logging.WARNING, logger="nanovllm"):
        threads = [threading.Thread(target=cpu_kernels.build_once, args=(target,)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cpu_kernels.build_once(target)  # already there: nothing built, nothing said
    assert calls == [target] and target.read_bytes() == b"library"
    said = [r for r in caplog.records if "compiling the CPU C kernels" in r.getMessage()]
    assert len(said) == 1 and str(target.parent) in said[0].getMessage()


OUT_OF_MEMORY = """
import re, resource, sys
import numpy as np, torch
from nanovllm.kernels import cpu_kernels
from nanovllm.layers.quantization.base import CWeightView
from nanovllm.layers.quantization.quantizers import quantize_rows
k = cpu_kernels.load()
n, cols, rows = 32, 4096, 16384
w = quantize_rows(torch.randn(n, cols), "q8_0")
lin = cpu_kernels.linear_struct(k, CWeightView("q8_0", w, n, cols, w.shape[1]))
cpu_kernels.linear(k, lin, torch.randn(2, cols), None)  # the thread team and a small scratch exist
x = torch.randn(rows, cols)
y = torch.empty(rows, n)
vm = int(re.search(r"VmSize:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
# room for Python's own small allocations, not for the quantized copy of 16384 rows (~135 MB, more than a malloc arena reserves)
resource.setrlimit(resource.RLIMIT_AS, (vm + (8 << 20), resource.RLIM_INFINITY))
try:
    cpu_kernels.linear(k, lin, x, None)
except MemoryError as e:
    print("MemoryError:", e)
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
small = torch.randn(3, cols)
ours = cpu_kernels.linear(k, lin, small, None)  # the process goes on and later calls work
ref = small @ torch.from_numpy(__import__("gguf").quants.dequantize(w.numpy(), __import__("gguf").GGMLQuantizationType.Q8_0)).T
print("after:", float((ours - ref).abs().max() / ref.abs().max()))
"""


def test_a_failed_allocation_is_a_memory_error_not_the_end_of_the_process():
    """A row loop that cannot allocate its quantized inputs skips its rows and the call raises
    MemoryError; the process (a server) goes on, and the next call computes."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", OUT_OF_MEMORY], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MemoryError: the C linear kernel could not allocate the quantized copy of 16384 input rows" in out.stdout
    after = float(out.stdout.split("after:")[1])
    assert after < 0.02, out.stdout  # q8_0 inputs against the fp32 product of the dequantized weight
