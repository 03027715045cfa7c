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


def cache_with_built_kernels(cache: Path) -> Path:
    """cache holding only the C kernels this session already built (linked, not copied), for a script
    run that loads a model but must fetch nothing: it then skips the kernels' compile."""
    from nanovllm.kernels import cpu_kernels
    if cpu_kernels.load() is not None:
        (cache / "kernels").symlink_to(cpu_kernels.library_path().parent, target_is_directory=True)
    return cache


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 1, proc.stderr[-2000:]
    assert proc.stdout == ""
    return lines[0]

