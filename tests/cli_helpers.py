"""Running the project's scripts as a user does, and reading their one-line errors."""
import os
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]


def run(*args: str, cache: Path) -> subprocess.CompletedProcess:
    # NOTE: an empty cache folder: a script that reached the default-model download by mistake would
    # start fetching it, and the test would time out instead of passing.
    env = dict(os.environ, PYTHONPATH=str(REPO), NANOVLLM_CACHE=str(cache), OMP_WAIT_POLICY="PASSIVE")
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 1, proc.stderr[-2000:]
    assert proc.stdout == ""
    return lines[0]

