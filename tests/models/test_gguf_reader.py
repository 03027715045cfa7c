"""loader/gguf_reader.py against the gguf package's GGUFReader on the same files (every metadata
value and every tensor's type, shape, offset and bytes), its refusals of damaged files, and what
loading a GGUF costs in memory: the weights held once (each tensor's bytes as the file stores them)
and a peak of the weights plus about one tensor."""
import os
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf_helpers import model_of, write_tiny  # noqa: E402
from nanovllm.loader.gguf_reader import GGUFMetadata  # noqa: E402


def metadata_file(path):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_uint8("t.u8", 7)
    w.add_int16("t.i16", -3)
    w.add_uint64("t.u64", 2**40)
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.text", "héllo")
    w.add_array("t.strings", ["a", "", "ü" * 300, "z"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 64)).astype(np.float16))
    w.add_tensor("q8", gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("vec", np.arange(7, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reads_what_ggufs_reader_reads(tmp_path):
    path = metadata_file(tmp_path / "m.gguf")
    theirs, ours = gguf.GGUFReader(str(path)), GGUFMetadata(str(path))
    header = {k for k in theirs.fields if k.startswith("GGUF.")}  # its own pseudo-fields (version, counts)
    assert set(ours.fields) == set(theirs.fields) - header
    for key, field in theirs.fields.items():
        if key in header:
            continue
        value = ours.fields[key]
        value = value.tolist() if isinstance(value, np.ndarray) else value
        want = field.contents()
        if key == "t.nested":  # (its contents() flattens an array of arrays)
            value = [x for inner in value for x in inner]
        if isinstance(want, float):
            assert value == pytest.approx(want, rel=1e-7), key
        elif isinstance(want, list) and want and isinstance(want[0], float):
            assert value == pytest.approx(want), key
        else:
            assert value == want, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.shape.tolist(), a.n_bytes, a.data_offset) == \
               (b.tensor_type, b.shape.tolist(), b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name
    ours.close()


def test_damaged_files_refused(tmp_path):
    good = metadata_file(tmp_path / "m.gguf").read_bytes()
    cases = {"magic": b"GGUG" + good[4:], "version": good[:4] + (9).to_bytes(4, "little") + good[8:],
             "header": good[:100], "tensors": good[:-64]}
    for what, data in cases.items():
        path = tmp_path / f"{what}.gguf"
        path.write_bytes(data)
        with pytest.raises(ValueError, match={"magic": "bad magic", "version": "GGUF version 9",
                                              "header": "past the end", "tensors": "past the end"}[what]):
            GGUFMetadata(str(path))


def test_weights_held_once(tmp_path):
    """The held bytes the start-up line reports are the file's own: each block-format matrix at its
    stored size (8-row groups repacked in place), each vector as fp32, plus the model's buffers."""
    from nanovllm import LLM
    types = {r: "q8_0" for r in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                                 "token_embd")}
    path = write_tiny(tmp_path / "q8.gguf", "llama", types)
    reader = gguf.GGUFReader(str(path))
    file_bytes = sum(t.n_bytes if len(t.shape) > 1 else 4 * int(t.n_elements) for t in reader.tensors)
    with LLM(str(path), max_num_seqs=2, max_model_len=64) as llm:
        model = model_of(llm)
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        assert llm.llm_engine.model_runner.weight_bytes == file_bytes + buffers


# (VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's, which execve keeps)
PEAK = """
import sys
from nanovllm import LLM
def kib(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))
before = kib("VmHWM")
llm = LLM(sys.argv[1], max_num_seqs=1, max_model_len=64)
print(before // 1024, kib("VmHWM") // 1024, llm.llm_engine.model_runner.weight_bytes // 2**20)
"""


def test_load_peak_is_the_weights_and_one_tensor(tmp_path):
    """A file of ~150 MiB (a 96k-token table and layers in Q8_0): loading it raises the process's
    peak by the weights, one tensor on its way (the table, 41 MiB) and some slack, not by the
    file's pages beside the copies or the metadata's objects."""
    types = {r: "q8_0" for r in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                                 "token_embd")}
    path = write_tiny(tmp_path / "big.gguf", "llama", types, hidden=448, inter=1536, layers=36, heads=7, kv_heads=7,
                      vocab=96000)
    assert os.path.getsize(path) > 140 * 2**20
    out = subprocess.run([sys.executable, "-c", PEAK, str(path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    before, peak, weights = map(int, out.stdout.split()[-3:])
    table = 96000 * 448 * 34 // 32 / 2**20
    print(f"peak {peak} MiB, before the engine {before} MiB, weights {weights} MiB, table {table:.0f} MiB")
    assert weights > 140
    # torch's and the engine's other imports, the KV cache's first pages and the tokenizer-less
    # config take well under 100 MiB; the file's pages or a second copy of the weights would not fit
    assert peak - before < weights + table + 100, (before, peak, weights)
