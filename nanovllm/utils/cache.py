"""The nanovllm cache folder (converted default model, built CPU kernels). Used by
utils/default_model.py and kernels/cpu_kernels.py."""
import os
from pathlib import Path

CACHE_ENV = "NANOVLLM_CACHE"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """cache_dir, else $NANOVLLM_CACHE, else $XDG_CACHE_HOME/nanovllm (~/.cache/nanovllm)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser().absolute()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "nanovllm"
