"""The engine's OpenMP wait default (nanovllm/utils/threads.py): set on import, before torch loads
libgomp, unless the user set their own; it reaches the runtime (idle threads stop spinning soon,
measured as the CPU time they burn between parallel regions); a late import is said at start-up."""
import os
import subprocess
import sys

import pytest

from nanovllm.utils import threads

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def python(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in threads.USER_ENVS}
    base["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip()


SHOW = "import nanovllm, os; from nanovllm.utils import threads; print(threads.wait_setting, os.environ.get('GOMP_SPINCOUNT'))"


def test_import_sets_the_default_unless_the_user_chose():
    assert python(SHOW) == f"set {threads.DEFAULT_SPINS}"
    assert python(SHOW, OMP_WAIT_POLICY="PASSIVE") == "user None"
    assert python(SHOW, GOMP_SPINCOUNT="77") == "user 77"
    assert python("import torch; " + SHOW) == f"late {threads.DEFAULT_SPINS}"  # for child processes


# 300 parallel adds with 5 ms pauses: the process's CPU seconds beyond the adds are the idle thread
# spinning after each one (libgomp's default spins ~300,000 times, a few ms, before it sleeps).
SPIN_CPU = """
import time, os
{first}
import torch
torch.set_num_threads(2)
x = torch.ones(1 << 20)
t0 = os.times()
for _ in range(300):
    x.add_(1.0)
    time.sleep(0.005)
t1 = os.times()
print(t1.user + t1.system - t0.user - t0.system)
"""


@pytest.mark.skipif(os.cpu_count() < 2, reason="needs a second core for an OpenMP worker")
def test_the_default_reaches_the_openmp_runtime():
    ours = float(python(SPIN_CPU.format(first="import nanovllm")))
    libgomp = float(python(SPIN_CPU.format(first="import nanovllm"), GOMP_SPINCOUNT="300000"))
    assert ours < 0.5 * libgomp, (ours, libgomp)


def test_a_late_import_is_said_at_start_up():
    out = python("import torch, logging, nanovllm; from nanovllm.utils.threads import wait_note; print(wait_note())")
    assert "imported before nanovllm" in out and f"GOMP_SPINCOUNT={threads.DEFAULT_SPINS}" in out
    assert python("import nanovllm; from nanovllm.utils.threads import wait_note; print(wait_note())") == "None"


def test_llama_cpp_beside_the_engine_keeps_its_own_default():
    out = python("import nanovllm; from nanovllm.utils.threads import environ_for_other_programs as e; "
                 "print(e().get('GOMP_SPINCOUNT'))")
    assert out == "None"
    assert python("import nanovllm; from nanovllm.utils.threads import environ_for_other_programs as e; "
                  "print(e().get('GOMP_SPINCOUNT'))", GOMP_SPINCOUNT="5") == "5"
