"""llama.cpp for scripts/bench_llamacpp.py: fetches the llama.cpp vendored in the llama-cpp-python sdist,
builds llama-bench, llama-batched-bench, llama-quantize, llama-perplexity, the speculation tools
(llama-lookup, llama-speculative) and llama-server, and converts HF folders to GGUF, all cached in the nanovllm
cache folder (keyed by version) so a second run does none of it again. The same for ik_llama.cpp (the
CPU-speed fork, vendored in the ik-llama-cpp-python sdist), a second reference: fork="ik_llama.cpp"."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

VERSION = "0.3.36"  # llama-cpp-python release; it vendors llama.cpp commit 0c1e570
TARGETS = ("llama-bench", "llama-batched-bench", "llama-quantize", "llama-perplexity", "llama-lookup",
           "llama-speculative", "llama-server", "llama-imatrix")


class Fork(NamedTuple):
    package: str  # the PyPI sdist that vendors it
    version: str
    vendor: str  # its folder under the sdist's vendor/
    targets: tuple[str, ...]


FORKS = {
    "llama.cpp": Fork("llama-cpp-python", VERSION, "llama.cpp", TARGETS),
    # Only the benchmark tools: files are converted and quantized by mainline llama.cpp's, so both
    # forks read the same bytes.
    "ik_llama.cpp": Fork("ik-llama-cpp-python", "0.1.5", "ik_llama.cpp", ("llama-bench", "llama-batched-bench")),
}
OUTTYPES = ("f32", "f16", "q8_0")
CONVERTER_DEPS = ("numpy", "sentencepiece", "safetensors", "torch", "transformers")
QWEN2_VOCAB = "models/ggml-vocab-qwen2.gguf"  # 151936 tokens, the Qwen2/Qwen3 tokenizer
# The instruction sets llama.cpp is built for. "native": every extension of this CPU but AMX (ggml's
# AMX matmul dies at its first `ldtilecfg` on VMs that list AMX: SIGSEGV on Q8_0 files; nano-vLLM
# has no AMX path either). "avx2": AVX2 + FMA + F16C, what AVX2-only machines run (pair it with
# OUR_ISA_ENV on our side).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
ISA_FLAGS = {
    "native": ["-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"],
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_BMI2=ON"],
}

# Our side of "avx2": the C kernels built for x86-64-v3 (cpu_kernels.MARCH_ENV), and torch's own
# kernels held to AVX2 too: ATen's vectorized ops, oneDNN and MKL pick AVX-512 at run time where the
# CPU has it (the fp32 path's larger batches and prefill run on MKL; attention on ATen).
OUR_ISA_ENV = {"avx2": {"NANOVLLM_CPU_MARCH": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2",
                        "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}


def use_isa(isa: str) -> None:
    """Set our side's environment for isa (variables already set are kept). They are read once, as
    torch starts: a script that has imported torch already is started again with them."""
    added = {k: v for k, v in OUR_ISA_ENV.get(isa, {}).items() if k not in os.environ}
    if not added:
        return
    os.environ.update(added)
    if "torch" in sys.modules:
        os.execv(sys.executable, [sys.executable, *sys.argv])


class BuildError(RuntimeError):
    """A step of fetching, building or converting failed; the message names it and its log."""


def run_step(step: str, cmd: list[str], log: Path, stdout: Path | None = None, cwd: Path | None = None) -> float:
    """Run cmd (in cwd: ik_llama.cpp's tools write llama.log there) with its output in log (stdout
    in its own file when given); raise BuildError with the log's last lines when it fails. Returns
    the process's peak RSS in MiB."""
    from nanovllm.utils.threads import environ_for_other_programs  # here: after bench_llamacpp's env changes
    log.parent.mkdir(parents=True, exist_ok=True)
    peak_kib = 0
    with open(log, "w") as f, open(stdout or os.devnull, "w") as out:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=out if stdout else f, stderr=f, env=environ_for_other_programs(),
                                    cwd=cwd)
            # NOTE: the program's own high-water mark (VmHWM, reset at exec), polled: a child's
            # rusage would count the parent's pages it held between fork and exec.
            while proc.poll() is None:
                peak_kib = max(peak_kib, _high_water_kib(proc.pid))
                time.sleep(0.05)
            rc = proc.returncode
        except OSError as e:
            f.write(f"cannot start: {e}\n")
            rc = -1
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-8:])
        raise BuildError(f"{step} failed (exit code {rc}); last lines of {log}:\n{tail}")
    return peak_kib / 1024


def _high_water_kib(pid: int) -> int:
    """VmHWM of a running process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def work_dir(cache: Path, fork: str = "llama.cpp") -> Path:
    return cache / f"{fork}-{FORKS[fork].version}"


def fetch_source(cache: Path, fork: str = "llama.cpp") -> Path:
    """The vendored source folder of fork (a key of FORKS), unpacked from its sdist on first use."""
    package, version, vendor, _ = FORKS[fork]
    src = work_dir(cache, fork) / "src"
    llama = src / "vendor" / vendor
    if (llama / "CMakeLists.txt").is_file():
        return llama
    work_dir(cache, fork).mkdir(parents=True, exist_ok=True)
    logs = work_dir(cache, fork) / "logs"
    stem = package.replace("-", "_")
    with tempfile.TemporaryDirectory(dir=work_dir(cache, fork), prefix=".fetch-") as tmp:
        run_step(f"pip download of the {package} sdist",
                 [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", package,
                  "--disable-pip-version-check", "--dest", tmp, f"{package}=={version}"],
                 logs / "download.log")
        sdists = list(Path(tmp).glob(f"{stem}-*.tar.gz"))
        if not sdists:
            raise BuildError(f"pip download left no sdist in {tmp}; see {logs / 'download.log'}")
        with tarfile.open(sdists[0]) as tar:  # the "data" filter refuses links and paths out of tmp
            tar.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        unpacked = Path(tmp) / f"{stem}-{version}"
        if not (unpacked / "vendor" / vendor / "CMakeLists.txt").is_file():
            raise BuildError(f"the sdist {sdists[0].name} has no vendor/{vendor}")
        complete_build_info(unpacked / "vendor" / vendor, f"{package}-{version}")
        shutil.rmtree(src, ignore_errors=True)
        os.replace(unpacked, src)  # atomic: the source folder is whole or absent
    return llama


def complete_build_info(llama: Path, label: str) -> None:
    """The ik-llama-cpp-python sdist leaves out common/cmake/build-info-gen-cpp.cmake, the script its
    build runs to fill in common/build-info.cpp.in (commit and compiler strings the tools print):
    write one that fills it in with the sdist's name."""
    script = llama / "common" / "cmake" / "build-info-gen-cpp.cmake"
    if script.is_file() or not (llama / "common" / "build-info.cpp.in").is_file():
        return
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(f"""set(BUILD_NUMBER 0)
set(BUILD_COMMIT "{label}")
set(BUILD_COMPILER "${{CMAKE_C_COMPILER_ID}} ${{CMAKE_C_COMPILER_VERSION}}")
set(BUILD_TARGET "${{CMAKE_SYSTEM_PROCESSOR}}")
configure_file(common/build-info.cpp.in common/build-info.cpp @ONLY)
""")


def build_tool(name: str) -> str:
    """cmake or ninja from PATH, else from pip (installed into this Python's environment)."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found:
        return found
    run_step(f"pip install {name}", [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", name],
             Path(tempfile.gettempdir()) / f"nanovllm-pip-{name}.log")
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    if not found:
        raise BuildError(f"pip installed {name} but no `{name}` is next to {sys.executable}")
    return found


def ensure_converter_deps() -> None:
    """The converter imports these (gguf comes vendored); pip-install the missing ones like cmake above."""
    import importlib.util
    missing = [m for m in CONVERTER_DEPS if importlib.util.find_spec(m) is None]
    if missing:
        print(f"installing {', '.join(missing)} with pip for convert_hf_to_gguf.py ...", flush=True)
        run_step(f"pip install {' '.join(missing)}",
                 [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *missing],
                 Path(tempfile.gettempdir()) / "nanovllm-pip-converter.log")


def build_llamacpp(cache: Path, jobs: int | None = None, isa: str = "native", fork: str = "llama.cpp") -> dict[str, Path]:
    """Paths of fork's targets built for isa (a key of ISA_FLAGS), configuring and building them only
    when the stamp (which names the flags) is missing or differs."""
    if isa not in ISA_FLAGS:
        raise BuildError(f"no llama.cpp build for instruction set {isa!r}; choose from {sorted(ISA_FLAGS)}")
    if fork not in FORKS:
        raise BuildError(f"no fork {fork!r}; choose from {sorted(FORKS)}")
    targets = FORKS[fork].targets
    work = work_dir(cache, fork)
    build = work / f"build-{isa}"
    bins = {t: build / "bin" / t for t in targets}
    stamp = work / f"build-{isa}-ok.json"
    recipe = {FORKS[fork].package.replace("-", "_"): FORKS[fork].version, "targets": list(targets),
              "flags": ISA_FLAGS[isa]}
    if stamp.is_file() and json.loads(stamp.read_text()) == recipe and all(p.is_file() for p in bins.values()):
        return bins
    llama = fetch_source(cache, fork)
    cmake, ninja = build_tool("cmake"), build_tool("ninja")
    print(f"building {fork} ({', '.join(targets)}, {isa}) in {build} (once; minutes) ...", flush=True)
    run_step(f"cmake configure of {fork}",
             [cmake, "-S", str(llama), "-B", str(build), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
              *ISA_FLAGS[isa], "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"],
             work / "logs" / f"configure-{isa}.log")
    run_step(f"cmake build of {fork}",
             [cmake, "--build", str(build), "--target", *targets, "-j", str(jobs or os.cpu_count() or 1)],
             work / "logs" / f"build-{isa}.log")
    missing = [str(p) for p in bins.values() if not p.is_file()]
    if missing:
        raise BuildError(f"the {fork} build finished but left no {', '.join(missing)}")
    stamp.write_text(json.dumps(recipe))
    return bins


def fingerprint(model_dir: str) -> str:
    """Short key of a HF folder's config and weight files, so a rebuilt checkpoint is converted anew."""
    h = hashlib.sha256((Path(model_dir) / "config.json").read_bytes())
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    return h.hexdigest()[:10]


def convert_to_gguf(cache: Path, model_dir: str, name: str, outtype: str) -> Path:
    """model_dir converted by the vendored convert_hf_to_gguf.py, cached as gguf/<name>-<key>-<outtype>.gguf.

    A folder without tokenizer files (bench.py's random Qwen3) gets the vendored Qwen2 vocabulary."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}, got {outtype!r}")
    out = work_dir(cache) / "gguf" / f"{name}-{fingerprint(model_dir)}-{outtype}.gguf"
    if out.is_file():
        return out
    llama = fetch_source(cache)
    ensure_converter_deps()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    with open(Path(model_dir) / "config.json") as f:
        config = json.load(f)
    architectures = config.get("architectures", [])
    if not any((Path(model_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        glm = any(a.startswith("Glm4Moe") for a in architectures)
        model_dir = str(with_qwen2_tokenizer(model_dir, llama, work_dir(cache) / f"{name}-with-vocab",
                                             GLM_SPECIALS if glm else ()))
    print(f"converting {model_dir} to {out.name} (once) ...", flush=True)
    # The converter expects a Qwen3.5 / Qwen3-Next checkpoint's MTP head unless told there is none.
    no_mtp = ["--no-mtp"] if any(a.startswith(("Qwen3_5", "Qwen3Next")) for a in architectures) \
        and not config.get("mtp_num_hidden_layers") else []
    # The converter puts its own (vendored) gguf-py first on sys.path.
    run_step(f"conversion of {name} to {outtype}",
             [sys.executable, str(llama / "convert_hf_to_gguf.py"), model_dir, "--outtype", outtype,
              "--outfile", str(tmp), *no_mtp],
             work_dir(cache) / "logs" / f"convert-{name}-{outtype}.log")
    os.replace(tmp, out)
    return out


def convert_lora(cache: Path, adapter_dir: str, base_dir: str, outfile: Path, outtype: str = "f32") -> Path:
    """A PEFT adapter folder written as llama.cpp's GGUF adapter by the vendored convert_lora_to_gguf.py
    (base_dir: the HF folder of its base model, whose config the converter reads)."""
    llama = fetch_source(cache)
    tmp = outfile.with_name(f".{outfile.name}.tmp")
    run_step(f"conversion of the adapter {adapter_dir} to {outtype}",
             [sys.executable, str(llama / "convert_lora_to_gguf.py"), "--base", base_dir, "--outtype", outtype,
              "--outfile", str(tmp), adapter_dir],
             outfile.parent / f"{outfile.name}.log")
    os.replace(tmp, outfile)
    return outfile


def source_fetched(cache: Path, fork: str = "llama.cpp") -> Path | None:
    """The fork's vendored source folder where it is already unpacked (nothing is fetched), else None."""
    llama = work_dir(cache, fork) / "src" / "vendor" / FORKS[fork].vendor
    return llama if (llama / "CMakeLists.txt").is_file() else None


# llama-quantize presets the benchmark writes (from the F32 conversion), by our name for them.
PRESETS = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K", "q3_k_m": "Q3_K_M",
           "q2_k": "Q2_K", "iq4_xs": "IQ4_XS", "iq4_nl": "IQ4_NL", "iq3_s": "IQ3_S", "iq3_xxs": "IQ3_XXS",
           "iq2_xxs": "IQ2_XXS", "iq2_xs": "IQ2_XS", "iq2_s": "IQ2_S", "iq1_s": "IQ1_S", "iq1_m": "IQ1_M"}
# The presets llama-quantize writes only with an importance matrix (llama-imatrix's, over the text
# the perplexity is scored on: tests/data/english.txt).
NEEDS_IMATRIX = ("iq3_xxs", "iq2_xxs", "iq2_xs", "iq2_s", "iq1_s", "iq1_m")


def importance_matrix(cache: Path, bins: dict[str, Path], source: Path) -> Path:
    """llama-imatrix's importance matrix of source over tests/data/english.txt, cached beside it."""
    out = source.with_name(source.name.replace(".gguf", "-imatrix.dat"))
    if out.is_file():
        return out
    text = Path(__file__).resolve().parent.parent / "tests" / "data" / "english.txt"
    tmp = out.with_name(f".{out.name}.tmp")
    run_step(f"llama-imatrix on {source.name}",
             [str(bins["llama-imatrix"]), "-m", str(source), "-f", str(text), "-o", str(tmp), "-c", "128",
              "-t", str(os.cpu_count() or 1)], work_dir(cache) / "logs" / f"imatrix-{source.stem}.log")
    os.replace(tmp, out)
    return out


def quantize_gguf(cache: Path, bins: dict[str, Path], source: Path, preset: str, embedding_type: str | None = None) -> Path:
    """source (an F32 GGUF) written by llama.cpp's own llama-quantize in a preset of PRESETS,
    cached beside it (…-<preset>.gguf); embedding_type: the token embedding (and a tied LM head)
    in that type instead (llama-quantize --token-embedding-type, …-<preset>-embd-<type>.gguf)."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    suffix = f"-lq-{preset}" + (f"-embd-{embedding_type}" if embedding_type else "")
    out = source.with_name(source.name.replace("-f32.gguf", f"{suffix}.gguf"))
    if out.is_file():
        return out
    tmp = out.with_name(f".{out.name}.tmp")
    print(f"llama-quantize {source.name} -> {out.name} (once) ...", flush=True)
    extra = ["--token-embedding-type", embedding_type, "--output-tensor-type", embedding_type] if embedding_type else []
    if preset in NEEDS_IMATRIX:
        extra += ["--imatrix", str(importance_matrix(cache, bins, source))]
    run_step(f"llama-quantize {PRESETS[preset]}",
             [str(bins["llama-quantize"]), *extra, str(source), str(tmp), PRESETS[preset]],
             work_dir(cache) / "logs" / f"quantize-{out.stem}.log")
    os.replace(tmp, out)
    return out


# Qwen2's pre-tokenizer split (its tokenizer.json), so the converter recognises the vocabulary as "qwen2".
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


# The special tokens llama.cpp's converter looks up in a GLM-4.5 tokenizer (its _set_vocab_glm),
# placed on ids the Qwen2 vocabulary leaves unused (its [PAD...] entries from 151646).
GLM_SPECIALS = ("[gMASK]", "<|user|>", "<|observation|>")


def with_qwen2_tokenizer(model_dir: str, llama: Path, dest: Path, specials: tuple[str, ...] = ()) -> Path:
    """dest: model_dir's files linked, plus a HF tokenizer.json rebuilt from the vendored Qwen2 vocab
    (with specials added on its unused ids)."""
    sys.path.insert(0, str(llama / "gguf-py"))
    import gguf  # the vendored gguf-py, the one the converter uses

    reader = gguf.GGUFReader(str(llama / QWEN2_VOCAB))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    normal, control = gguf.TokenType.NORMAL, gguf.TokenType.CONTROL
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}
                         for i, t in [(i, t) for i, (t, ty) in enumerate(zip(tokens, types)) if ty == control]
                         + list(enumerate(specials, start=151646))],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == normal},
                  "merges": [m.split(" ") for m in merges]},
    }
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for f in Path(model_dir).iterdir():
        (dest / f.name).symlink_to(f.absolute())
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "add_bos_token": False}))
    return dest


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="llama.cpp's sources, tools and converters in the nanovllm cache")
    parser.add_argument("--source", action="store_true",
                        help="fetch llama.cpp's vendored source (its converters: the GGUF adapter tests' reference "
                             "writer) and the converters' Python dependencies; build nothing")
    parser.add_argument("--build", choices=sorted(ISA_FLAGS), help="also build the benchmark tools for this ISA")
    cli = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from nanovllm.utils.cache import cache_root
    if not cli.source and not cli.build:
        parser.error("nothing to do: give --source and / or --build")
    print(fetch_source(cache_root()))
    ensure_converter_deps()
    if cli.build:
        print(build_llamacpp(cache_root(), isa=cli.build))
