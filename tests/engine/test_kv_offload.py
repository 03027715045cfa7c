"""The tier under the prefix cache (kv_offload/): what it writes is read back after a restart and
gives a cold run's answer; a damaged, truncated or foreign file is detected and recomputed; another
model or KV format never hits; the directory stays within its size; faults fail no request; and a
request whose prefix is being read waits aside while the others go on."""
import errno
import io
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine_args import EngineArgs
from nanovllm.kv_offload import block_file
from nanovllm.kv_offload.block_file import BadBlockFile, BlockKey
from nanovllm.kv_offload.stores import DiskStore

OPTIONS = dict(device="cpu", kvcache_block_size=16, max_model_len=256, cpu_kvcache_bytes=64 * 16 * 2048)
PROMPT = [(7 * i + 3) % 250 + 3 for i in range(100)]  # 6 full blocks (the 7th, partial, is always computed)
PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=3)


def generate(model: str, prompts=(PROMPT,), **kwargs) -> tuple[list[dict], dict | None]:
    """Outputs, and the tier's counters once its writes are done (None without a tier)."""
    llm = LLM(model, **OPTIONS, **kwargs)
    try:
        outs = llm.generate([list(p) for p in prompts], PARAMS, use_tqdm=False)
        connector = llm.llm_engine.connector
        if connector is None:
            return outs, None
        assert connector.tier.flush(30)
        return outs, connector.tier.stats.as_dict()
    finally:
        llm.llm_engine.exit()


def block_files(root) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".kvb"))


def assert_same_answer(out: dict, ref: dict) -> None:
    assert out["token_ids"] == ref["token_ids"]
    for mine, theirs in zip(out["logprobs"], ref["logprobs"]):
        assert list(mine) == list(theirs)
        torch.testing.assert_close(torch.tensor(list(mine.values())), torch.tensor(list(theirs.values())),
                                   rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def cold(qwen3_gqa) -> dict:
    return generate(qwen3_gqa)[0][0]


@pytest.fixture(scope="module")
def written(qwen3_gqa, tmp_path_factory):
    """A directory the first engine wrote PROMPT's blocks into."""
    root = tmp_path_factory.mktemp("tier")
    outs, stats = generate(qwen3_gqa, kv_offloading_dir=str(root))
    assert stats["hit_tokens"] == 0 and stats["blocks_written"] == len(block_files(root)) == 6
    return root, outs[0]


# ---- the file format ----------------------------------------------------------------------------
KEY = BlockKey(0, 1234, 99, (5, 6, 7))


def encoded(fingerprint="f" * 32, key=KEY, payload=bytes(range(64))) -> bytes:
    return b"".join(bytes(p) for p in block_file.encode(fingerprint, key, memoryview(payload)))


def decoded(data: bytes, payload_len: int = 64) -> bytes:
    out = bytearray(payload_len)
    block_file.read_into(io.BytesIO(data), len(data), "f" * 32, KEY, [memoryview(out)])
    return bytes(out)


def test_block_file_round_trip_and_every_kind_of_damage():
    data = encoded()
    assert decoded(data) == bytes(range(64))
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    cases = {"truncated": data[:-9], "corrupted": bytes(flipped), "empty": b"",
             "another model's": encoded(fingerprint="e" * 32),
             "another block's": encoded(key=BlockKey(0, 1234, 99, (5, 6, 8))),
             "another group's": encoded(key=BlockKey(1, 1234, 99, (5, 6, 7)))}
    messages = {}
    for what, bad in cases.items():
        with pytest.raises(BadBlockFile) as e:
            decoded(bad)
        messages[what] = str(e.value)
    assert "checksum" in messages["corrupted"] and "truncated" in messages["truncated"]
    assert "fingerprint" in messages["another model's"] and "token_ids" in messages["another block's"]
    with pytest.raises(BadBlockFile):  # the right bytes, but the reader expects another payload size
        decoded(data, 32)


def test_directory_is_bounded_least_recently_used_first(tmp_path):
    payload = memoryview(bytes(4096))
    size = len(encoded(payload=bytes(4096)))
    store = DiskStore(str(tmp_path), 10 * size, "a" * 32)
    assert store.owner
    keys = [BlockKey(0, i, None, (i,)) for i in range(30)]
    for i, key in enumerate(keys):
        store.write(key, payload)
        if i == 2:
            os.utime(store.path(keys[0]), (1, 1))  # block 0 long unused: evicted first
            os.utime(store.path(keys[1]), (2, 2))
        if i >= 3:
            assert store.read(keys[2], [memoryview(bytearray(4096))])  # block 2 read after each write: always the most recently used
    total = sum(os.path.getsize(p) for p in block_files(tmp_path))
    assert total <= 10 * size
    assert store.contains(keys[2]) and store.contains(keys[-1])
    assert not store.contains(keys[0]) and not store.contains(keys[1])
    # A second process's store on the same directory does not own it: it never evicts.
    other = DiskStore(str(tmp_path), size, "a" * 32)
    assert not other.owner
    before = block_files(tmp_path)
    other.write(BlockKey(0, 999, None, (1,)), payload)
    assert set(before) <= set(block_files(tmp_path))
    store.close()
    other.close()


# ---- the engine ---------------------------------------------------------------------------------
def test_a_restart_reads_the_prefix_back_and_answers_as_cold(qwen3_gqa, written, cold):
    root, first = written
    assert_same_answer(first, cold)  # writing changes nothing
    outs, stats = generate(qwen3_gqa, kv_offloading_dir=str(root))
    assert stats["hit_tokens"] == stats["query_tokens"] == 6 * 16
    assert stats["blocks_read"] == 6 and stats["bytes_read"] > 0 and stats["bad_files"] == 0
    assert_same_answer(outs[0], cold)
    # Only the RAM tier (vLLM's kv_offloading_size) in one engine: a second request after the first's
    # blocks left the cache would hit; here both the cache and the RAM tier hold them.
    outs, stats = generate(qwen3_gqa, kv_offloading_size=0.01)
    assert stats["hit_tokens"] == 0 and stats["blocks_written"] == 0
    assert_same_answer(outs[0], cold)


@pytest.mark.parametrize("damage", ["corrupted", "truncated", "foreign"])
def test_damaged_files_are_detected_deleted_and_recomputed(qwen3_gqa, written, cold, tmp_path, damage, caplog):
    root = tmp_path / "tier"
    shutil.copytree(written[0], root)
    files = block_files(root)
    assert len(files) == 6
    victim = next(p for p in files if p.endswith(".kvb") and os.path.basename(p) == _third_block_name(files, root))
    data = bytearray(open(victim, "rb").read())
    if damage == "corrupted":
        data[len(data) // 2] ^= 0x40
    elif damage == "truncated":
        data = data[:len(data) // 3]
    else:  # another block's file under this block's name
        data = bytearray(open(next(p for p in files if p != victim), "rb").read())
    open(victim, "wb").write(data)
    with caplog.at_level(logging.WARNING, logger="nanovllm.kv_offload"):
        outs, stats = generate(qwen3_gqa, kv_offloading_dir=str(root))
    assert stats["bad_files"] == 1
    assert stats["hit_tokens"] == 2 * 16  # the two blocks before the damaged one
    assert any("unusable" in r.getMessage() and os.path.basename(victim) in r.getMessage() for r in caplog.records)
    assert_same_answer(outs[0], cold)
    # It was deleted and written again from the recomputed K/V: a third run reads all six.
    assert block_files(root) == files
    outs, stats = generate(qwen3_gqa, kv_offloading_dir=str(root))
    assert stats["hit_tokens"] == 6 * 16 and stats["bad_files"] == 0


def _third_block_name(files: list[str], root) -> str:
    """The file of PROMPT's third block (the chain: the block whose parent is the second's)."""
    from nanovllm.engine.block_pool import compute_block_hash
    parent = None
    for i in range(3):
        h = compute_block_hash(PROMPT[16 * i:16 * (i + 1)], parent)
        parent = h
    return BlockKey(0, h, None, ()).name


def test_another_model_or_kv_format_on_the_same_directory_never_hits(qwen3_gqa, qwen3_bias_tied, written, tmp_path):
    root = tmp_path / "tier"
    shutil.copytree(written[0], root)
    for model, kwargs in [(qwen3_bias_tied, {}), (qwen3_gqa, {"kv_cache_dtype": "bfloat16"}),
                          (qwen3_gqa, {"kvcache_block_size": 32})]:
        options = dict(OPTIONS, **kwargs)
        llm = LLM(model, **{**options, "kv_offloading_dir": str(root)})
        try:
            llm.generate([PROMPT], PARAMS, use_tqdm=False)
            stats = llm.llm_engine.connector.tier.stats
            assert stats.query_tokens > 0 and stats.hit_tokens == 0, kwargs
        finally:
            llm.llm_engine.exit()
    # each wrote its own blocks beside the first model's, in folders of their own
    assert len([d for d in os.listdir(root) if not d.startswith(".")]) == 4


def test_a_tier_fault_fails_no_request(qwen3_gqa, written, cold, tmp_path, monkeypatch, caplog):
    root = tmp_path / "tier"
    shutil.copytree(written[0], root)

    def failing(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(DiskStore, "read", failing)
    outs, stats = generate(qwen3_gqa, kv_offloading_dir=str(root))
    assert stats["io_errors"] == 1 and stats["hit_tokens"] == 0
    assert_same_answer(outs[0], cold)
    monkeypatch.undo()
    # A write that fails, then a full disk: serving goes on; the full disk stops writes with one WARNING.
    fresh = tmp_path / "fresh"
    monkeypatch.setattr(block_file, "encode", failing)
    monkeypatch.setattr("nanovllm.kv_offload.stores.encode", failing)
    outs, stats = generate(qwen3_gqa, kv_offloading_dir=str(fresh))
    assert stats["io_errors"] == 6 and stats["blocks_written"] == 0 and not block_files(fresh)
    assert_same_answer(outs[0], cold)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr("nanovllm.kv_offload.stores.encode", full)
    with caplog.at_level(logging.WARNING, logger="nanovllm.kv_offload"):
        outs, stats = generate(qwen3_gqa, prompts=[PROMPT, PROMPT[::-1]], kv_offloading_dir=str(fresh))
    assert [r.getMessage().startswith("KV offloading: no space left") for r in caplog.records].count(True) == 1
    assert stats["io_errors"] == 0 and stats["blocks_written"] == 0
    assert_same_answer(outs[0], cold)


def test_the_directory_stays_within_its_size(qwen3_gqa, tmp_path):
    root = tmp_path / "tier"
    block = 16 * 512  # a block of the tiny model's K/V (512 bytes per token) without its header
    limit_gib = 20 * block / 2**30
    prompts = [[(13 * j + 5 * i) % 250 + 3 for i in range(100)] for j in range(8)]  # 48 blocks in all
    llm = LLM(qwen3_gqa, **OPTIONS, kv_offloading_dir=str(root), kv_offloading_dir_size=limit_gib)
    try:
        for prompt in prompts:
            llm.generate([prompt], PARAMS, use_tqdm=False)
            assert llm.llm_engine.connector.tier.flush(30)
            assert sum(os.path.getsize(p) for p in block_files(root)) <= limit_gib * 2**30
        assert llm.llm_engine.connector.tier.stats.blocks_written == 48
    finally:
        llm.llm_engine.exit()


def test_an_unusable_directory_or_setting_is_a_clear_error(qwen3_gqa, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="kv_offloading_dir .* is not a directory this process can write"):
        LLM(qwen3_gqa, **OPTIONS, kv_offloading_dir=str(a_file / "sub"))
    for kwargs, message in [(dict(kv_offloading_size=-1), "kv_offloading_size must be a positive"),
                            (dict(kv_offloading_dir_size=0, kv_offloading_dir="x"), "kv_offloading_dir_size must"),
                            (dict(kv_offloading_backend="lmcache", kv_offloading_size=1), "must be 'native'"),
                            (dict(kv_offloading_backend="native"), "needs kv_offloading_size"),
                            (dict(kv_offloading_dir="x", tensor_parallel_size=2), "tensor_parallel_size 1")]:
        with pytest.raises(ValueError, match=message):
            EngineArgs(qwen3_gqa, **kwargs)
    assert EngineArgs(qwen3_gqa, kv_offloading_dir="x").kv_offloading_backend == "native"


SHARER = textwrap.dedent("""
    import sys
    from nanovllm import LLM, SamplingParams
    model, root, options = sys.argv[1], sys.argv[2], eval(sys.argv[3])
    llm = LLM(model, **options, kv_offloading_dir=root)
    tier = llm.llm_engine.connector.tier
    print("owner" if tier.disk.owner else "sharer", flush=True)
    for line in sys.stdin:  # one prompt per line: generate, then say what the tier read
        prompt = [int(t) for t in line.split()]
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
        tier.flush(30)
        print(tier.stats.hit_tokens, *out["token_ids"], flush=True)
    llm.llm_engine.exit()
""")


def test_two_processes_share_a_directory(qwen3_gqa, tmp_path):
    root = str(tmp_path / "tier")
    options = repr({k: v for k, v in OPTIONS.items()})
    procs = [subprocess.Popen([sys.executable, "-c", SHARER, qwen3_gqa, root, options], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        roles = [procs[0].stdout.readline().strip()]
        roles.append(procs[1].stdout.readline().strip())
        assert sorted(roles) == ["owner", "sharer"]
        other = PROMPT[::-1]

        def ask(proc, prompt) -> list[int]:
            proc.stdin.write(" ".join(map(str, prompt)) + "\n")
            proc.stdin.flush()
            return [int(x) for x in proc.stdout.readline().split()]
        a_first = ask(procs[0], PROMPT)       # A computes PROMPT and writes it
        b_reads = ask(procs[1], PROMPT)       # B reads A's blocks
        b_other = ask(procs[1], other)        # B computes another prompt
        a_reads = ask(procs[0], other)        # A reads B's
        assert a_first[0] == 0 and b_reads[0] == 6 * 16 and b_reads[1:] == a_first[1:]
        assert a_reads[0] == 6 * 16 and a_reads[1:] == b_other[1:]
    finally:
        for proc in procs:
            proc.stdin.close()
            proc.wait(60)
    assert [proc.returncode for proc in procs] == [0, 0]


def test_the_ram_tier_keeps_what_the_cache_evicted(qwen3_gqa, cold):
    """vLLM's kv_offloading_size: blocks the engine's cache gave to other prompts come back from RAM."""
    small = dict(OPTIONS, cpu_kvcache_bytes=20 * 16 * 512, max_num_seqs=1)
    llm = LLM(qwen3_gqa, **small, kv_offloading_size=0.01)
    try:
        llm.generate([PROMPT], PARAMS, use_tqdm=False)
        for j in range(1, 4):  # 7 blocks each, 20 in the cache: PROMPT's blocks are taken
            llm.generate([[(11 * i + j) % 250 + 3 for i in range(100)]], PARAMS, use_tqdm=False)
        stats = llm.llm_engine.connector.tier.stats
        assert stats.hit_tokens == 0
        out = llm.generate([PROMPT], PARAMS, use_tqdm=False)[0]
        assert stats.hit_tokens == 6 * 16
        assert_same_answer(out, cold)
    finally:
        llm.llm_engine.exit()


class FakeTier:
    """Holds every block; a read finishes when the test says so."""

    def __init__(self):
        from nanovllm.kv_offload.tier import TierStats
        self.stats = TierStats()
        self.started: dict[int, list] = {}
        self.cancelled: list[int] = []

    def contains(self, key) -> bool:
        return True

    def start_load(self, seq_id, keys, block_ids) -> None:
        assert len(keys) == len(block_ids)
        self.started[seq_id] = block_ids

    def cancel(self, seq_id) -> None:
        self.cancelled.append(seq_id)


def test_a_request_whose_prefix_is_read_waits_aside_while_others_decode():
    from types import SimpleNamespace

    from nanovllm.engine.scheduler import Scheduler
    from nanovllm.engine.sequence import Sequence
    config = SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                             eos_token_ids=frozenset({0}), kvcache_block_size=4, enable_prefix_caching=True,
                             speculative_config=None, enable_lora=False, max_loras=1)
    tier = FakeTier()
    s = Scheduler(config, 64, tier=tier)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    running = Sequence([1, 2, 3], params)  # shorter than a block: nothing to read
    s.add(running)
    out = s.schedule()
    assert out.seqs == [running] and not tier.started
    s.postprocess(out, [5])
    loading = Sequence(list(range(10, 28)), params)  # 18 tokens: 4 full blocks to read, 2 tokens computed
    aborted = Sequence(list(range(40, 50)), params)
    s.add(loading)
    s.add(aborted)
    for _ in range(3):  # both wait for their reads; the running sequence decodes meanwhile
        out = s.schedule()
        assert not out.is_prefill and out.seqs == [running]
        s.postprocess(out, [5])
    assert set(s.loading) == {loading.seq_id, aborted.seq_id} and not s.waiting and not s.is_finished()
    assert [len(tier.started[loading.seq_id]), len(tier.started[aborted.seq_id])] == [4, 2]
    assert s.kv_cache_manager.num_free_blocks == 64 - 2 - 5 - 3  # the reads' blocks are held
    s.abort(aborted)
    assert tier.cancelled == [aborted.seq_id] and s.kv_cache_manager.num_free_blocks == 64 - 2 - 5
    assert tier.started[loading.seq_id] == loading.block_table[:4]  # read into its own blocks
    assert s.loaded(loading.seq_id, 3) is loading  # the fourth block's read failed: computed instead
    assert loading.num_computed_tokens == loading.num_cached_tokens == 12 and tier.stats.hit_tokens == 12
    out = s.schedule()
    assert out.is_prefill and out.seqs == [loading] and out.num_new_tokens == [6]
    assert s.loaded(aborted.seq_id, 2) is None


def test_a_cancelled_read_writes_no_block_after_cancel_returns(tmp_path):
    """An aborted request's blocks go back to the pool: the worker must be done writing into them."""
    import threading
    import time

    from nanovllm.kv_offload.tier import FILL_BLOCKS, KVTier
    store = DiskStore(str(tmp_path), 1 << 30, "c" * 32)
    keys = [BlockKey(0, i, None, (i,)) for i in range(4 * FILL_BLOCKS)]
    for key in keys:
        store.write(key, memoryview(bytes(64)))
    tier = KVTier(64, disk=store)
    filled, started = [], threading.Event()

    def fill(block_ids, data):
        started.set()
        time.sleep(0.05)
        filled.extend(block_ids)
    tier.fill = fill
    tier.start_load(7, keys, list(range(len(keys))))
    assert started.wait(10)
    tier.cancel(7)
    after_cancel = len(filled)
    time.sleep(0.3)
    assert len(filled) == after_cancel < len(keys)
    assert tier.finished_loads() == {}
    tier.start_load(8, keys[:3], [100, 101, 102])  # the worker goes on with other reads
    assert tier.flush(10) and tier.finished_loads() == {8: 3} and filled[-3:] == [100, 101, 102]
    tier.close()
