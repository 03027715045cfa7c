"""scripts/bench_prequantized.py's main() with both engines stubbed: which sources each row loads,
the engines alternating figure by figure, every helper called as its real signature allows, and
the table's ratios from a hand count."""
import importlib.util
import inspect
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script():
    sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("bench_prequantized", SCRIPTS / "bench_prequantized.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def checked(real, fake):
    """fake, after checking that each call would bind to real's signature."""
    signature = inspect.signature(real)

    def call(*args, **kwargs):
        signature.bind(*args, **kwargs)
        return fake(*args, **kwargs)
    return call


def test_rows_and_ratios(monkeypatch, tmp_path, capsys):
    bench = load_script()
    bl, build = bench.bl, bench.llamacpp_build
    monkeypatch.setattr(build, "build_llamacpp", checked(build.build_llamacpp, lambda cache, jobs, isa: {}))
    monkeypatch.setattr(build, "convert_to_gguf", checked(build.convert_to_gguf,
                                                          lambda cache, path, stem, quant: tmp_path / "f32.gguf"))
    monkeypatch.setattr(build, "quantize_gguf", checked(
        build.quantize_gguf, lambda cache, bins, src, quant, embedding_type=None:
        tmp_path / f"{quant}{'-f32emb' if embedding_type else ''}.gguf"))
    monkeypatch.setattr(bl, "sources", checked(bl.sources, lambda cache, bins, name, path, quant:
                                               (tmp_path / f"{quant}.gguf", str(tmp_path / f"{quant}.gguf"), "float32")))
    monkeypatch.setattr(bl, "model_folder", lambda name: str(tmp_path / "model"))
    monkeypatch.setattr(bench, "llmcompressor_folder",
                        checked(bench.llmcompressor_folder, lambda cache, src, scheme: str(tmp_path / scheme)))
    calls, started = [], []

    class Engine:
        def __init__(self, source):
            self.name = Path(source).name

        def exit(self):
            calls.append((self.name, "exit"))

    def start_ours(path, batches, threads, dtype, input_bits):
        started.append(Path(path).name)
        return Engine(path)

    # each engine's rate is fixed per row, so the ratios are a hand count
    rate_of = {"q8_0.gguf": 100.0, "q8_0-f32emb.gguf": 80.0, "int8-sym-group64": 84.0,
               "int8-sym-group64+head": 95.0, "q4_0.gguf": 120.0, "q4_0-f32emb.gguf": 90.0,
               "int4-sym-group64": 90.0, "int4-sym-group64+head8": 126.0}

    def llamacpp_point(bins, gguf, point, threads, logs, raw):
        calls.append((f"llama.cpp {gguf.name}", point))
        return 50.0, 200.0

    def ours_point(llm, point, rng, raw):
        calls.append((llm.name, point))
        return rate_of[llm.name]
    monkeypatch.setattr(bl, "start_ours", checked(bl.start_ours, start_ours))
    monkeypatch.setattr(bl, "llamacpp_point", checked(bl.llamacpp_point, llamacpp_point))
    monkeypatch.setattr(bl, "ours_point", checked(bl.ours_point, ours_point))
    monkeypatch.setattr(sys, "argv", ["bench_prequantized.py", "--batches", "1", "--rounds", "2"])
    bench.main()

    assert started == ["q8_0.gguf", "q8_0-f32emb.gguf", "int8-sym-group64", "int8-sym-group64+head",
                       "q4_0.gguf", "q4_0-f32emb.gguf", "int4-sym-group64", "int4-sym-group64+head8"]
    q8 = ["llama.cpp q8_0.gguf", "q8_0.gguf", "q8_0-f32emb.gguf", "int8-sym-group64", "int8-sym-group64+head"]
    expected = [(name, point) for point in (("decode", 1), ("prefill", 128)) for _ in range(2) for name in q8]
    assert calls[:len(expected)] == expected
    assert calls[len(expected):len(expected) + 4] == [(n, "exit") for n in q8[1:]]
    out = capsys.readouterr().out
    assert "| ours W8A16, int8 head / ours Q8_0 | 0.95x | 0.95x | |" in out
    assert "| ours W8A16 / ours Q8_0, F32 embedding | 1.05x | 1.05x | |" in out
    assert "| ours W4A16, int8 head / llama.cpp Q4_0 | 2.52x | 2.52x | |" in out
