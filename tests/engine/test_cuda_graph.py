"""Decode CUDA-graph logic that needs no GPU: bucket sizes, bucket choice, static-buffer padding, a
padded static-buffer forward giving the eager decode's logits, and capture order / replay dispatch
with torch.cuda's graph API faked on CPU."""

import pytest
import torch

from nanovllm.executor.cuda_graph import DecodeBuffers, DecodeGraphs, graph_batch_sizes, pick_graph_batch_size
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.layers.backends.torch_backend import TorchBackend, TorchMetadata
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.context import Context, forward_context
from tests.helpers import fake_cuda_graphs, make_qwen3


@pytest.mark.parametrize("max_num_seqs,expected", [
    (1, [1]),
    (3, [1, 2, 3]),
    (8, [1, 2, 4, 8]),
    (16, [1, 2, 4, 8, 16]),
    (20, [1, 2, 4, 8, 16, 20]),
    (48, [1, 2, 4, 8, 16, 32, 48]),
    (50, [1, 2, 4, 8, 16, 32, 48, 50]),
])
def test_graph_batch_sizes_small(max_num_seqs, expected):
    assert graph_batch_sizes(max_num_seqs) == expected


@pytest.mark.parametrize("max_num_seqs", [512, 1024])
def test_graph_batch_sizes_capped_at_512(max_num_seqs):
    sizes = graph_batch_sizes(max_num_seqs)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512
    assert len(sizes) == 4 + 512 // 16  # 1, 2, 4, 8 and the 32 multiples of 16
    assert all(b - a == 16 for a, b in zip(sizes[4:], sizes[5:]))


@pytest.mark.parametrize("max_num_seqs,batch,expected", [
    (512, 1, 1), (512, 3, 4), (512, 5, 8), (512, 8, 8), (512, 9, 16), (512, 17, 32),
    (512, 500, 512), (512, 512, 512), (512, 513, None), (1024, 600, None),
    (20, 17, 20), (20, 21, None), (3, 3, 3),
])
def test_pick_graph_batch_size(max_num_seqs, batch, expected):
    assert pick_graph_batch_size(graph_batch_sizes(max_num_seqs), batch) == expected


def decode_context(slots, lens, tables) -> Context:
    metadata = TorchMetadata(context_lens=torch.tensor(lens, dtype=torch.int32),
                             block_tables=torch.tensor(tables, dtype=torch.int32), max_seqlen_k=max(lens))
    return Context(is_prefill=False, slot_mapping=torch.tensor(slots), attn_metadata=metadata)


def allocate_buffers(max_seqlen_k: int = 64) -> DecodeBuffers:
    return DecodeBuffers.allocate(TorchBackend("cpu"), 8, 4, max_seqlen_k, hidden_size=3, dtype=torch.float32,
                                  device="cpu")


def test_buffers_fill_pads_and_overwrites_stale_rows():
    buf = allocate_buffers()
    tables = buf.backend.graph_tables  # the backend's static copies of its decode metadata
    assert buf.slot_mapping.tolist() == [-1] * 8 and tables.context_lens.tolist() == [1] * 8
    ctx = decode_context([37, 5, 70], [6, 22, 7], [[2, 3], [0, 1], [4, -1]])
    buf.fill(torch.tensor([11, 12, 13]), torch.tensor([5, 21, 6]), ctx, graph_bs=4)
    assert buf.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buf.positions[:4].tolist() == [5, 21, 6, 0]
    assert buf.slot_mapping[:4].tolist() == [37, 5, 70, -1]  # the padding row stores nothing
    assert tables.context_lens[:4].tolist() == [6, 22, 7, 1]
    assert tables.block_tables[:4].tolist() == [[2, 3, -1, -1], [0, 1, -1, -1], [4, -1, -1, -1], [0, 0, 0, 0]]

    # A smaller, narrower batch next: row 0's old entries must not survive.
    ctx = decode_context([9], [2], [[6]])
    buf.fill(torch.tensor([14]), torch.tensor([1]), ctx, graph_bs=2)
    assert buf.input_ids[:2].tolist() == [14, 0] and buf.slot_mapping[:2].tolist() == [9, -1]
    assert tables.block_tables[:2].tolist() == [[6, -1, -1, -1], [0, 0, 0, 0]]
    assert tables.context_lens[:2].tolist() == [2, 1]


def test_buffers_context_views_share_storage():
    # NOTE: a captured graph reads the addresses it saw at capture; fill() must write those.
    buf = allocate_buffers(max_seqlen_k=64)
    ctx = buf.context(4)
    meta, tables = ctx.attn_metadata, buf.backend.graph_tables
    assert meta.max_seqlen_k == 64 and not ctx.is_prefill
    assert meta.seqlens_k is None  # no host-side lengths: they would be frozen into the graph
    for view, full in ((ctx.slot_mapping, buf.slot_mapping), (meta.context_lens, tables.context_lens),
                       (meta.block_tables, tables.block_tables)):
        assert view.data_ptr() == full.data_ptr() and view.shape[0] == 4
    buf.fill(torch.tensor([3]), torch.tensor([0]), decode_context([4], [1], [[0]]), graph_bs=1)
    assert ctx.slot_mapping[0].item() == 4


def test_padded_static_forward_matches_eager_decode(tmp_path):
    """What a graph replay computes (the model over padded static buffers with a fixed-width block
    table), run eagerly on CPU, gives the eager decode's logits and stores the same K/V."""
    engine = LLMEngine(make_qwen3(str(tmp_path / "m")), device="cpu", dtype="float32", kv_cache_dtype="float32", max_model_len=128,
                       kvcache_block_size=16, cpu_kvcache_bytes=1 << 22)
    runner = engine.model_runner
    assert runner.step_runner(DecodeGraphs) is None and not engine.config.compile_ops  # CPU: eager, not compiled
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for prompt in ([5, 6, 7], list(range(10, 40)), list(range(50, 67))):  # 1, 2 and 2 blocks
        engine.add_request(prompt, params)
    engine.step()  # prefill all three
    out = engine.scheduler.schedule()
    assert not out.is_prefill and len(out.seqs) == 3
    input_ids, positions, context = runner.prepare_decode(out.seqs)
    eager = runner.run_model(input_ids, positions, context, None)
    cache_after_eager = runner.kv_cache.clone()

    max_blocks = -(-128 // 16)
    assert context.attn_metadata.block_tables.shape[1] < max_blocks  # the padded width really differs
    buf = DecodeBuffers.allocate(runner.backend, 8, max_blocks, 128, engine.config.hf_config.hidden_size,
                                 torch.float32, "cpu")
    buf.fill(input_ids, positions, context, graph_bs=4)
    with torch.inference_mode(), forward_context(buf.context(4)):
        buf.outputs[:4] = runner.model(buf.input_ids[:4], buf.positions[:4])
        padded = runner.model.compute_logits(buf.outputs[:3])
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(padded.argmax(-1), eager.argmax(-1))
    # The real rows rewrote their own slots (a 4-row matmul may round differently from a 3-row
    # one); the padding row stored nothing: every other slot is bit-identical.
    num_layers, num_blocks, block_size = runner.kv_cache.shape[1:4]
    slots = runner.kv_cache.view(2, num_layers, num_blocks * block_size, -1)
    slots_eager = cache_after_eager.view(2, num_layers, num_blocks * block_size, -1)
    written = context.slot_mapping
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(slots[:, :, untouched], slots_eager[:, :, untouched])
    torch.testing.assert_close(slots[:, :, written], slots_eager[:, :, written], rtol=1e-5, atol=1e-6)
    engine.exit()


def test_decode_graphs_capture_order_and_replay_dispatch(tmp_path, monkeypatch):
    engine = LLMEngine(make_qwen3(str(tmp_path / "m")), device="cpu", dtype="float32", kv_cache_dtype="float32", max_model_len=128,
                       max_num_seqs=20, kvcache_block_size=16, cpu_kvcache_bytes=1 << 22)
    runner = engine.model_runner
    captures = fake_cuda_graphs(monkeypatch)
    graphs = DecodeGraphs(runner.model, runner.backend, 20, 128, 16, engine.config.hf_config.hidden_size,
                          torch.float32, torch.device("cpu"))
    graphs.capture()
    assert [g.graph_bs for g in captures] == [20, 16, 8, 4, 2, 1]  # largest first
    assert {g.pool for g in captures} == {"the-pool"}  # one shared pool
    for g in captures:
        g.model, g.buffers = runner.model, graphs.buffers
        meta = g.context.attn_metadata
        assert meta.block_tables.shape == (g.graph_bs, 8) and meta.max_seqlen_k == 128

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for prompt in ([5, 6, 7], list(range(10, 40)), list(range(50, 67))):
        engine.add_request(prompt, params)
    engine.step()
    out = engine.scheduler.schedule()
    input_ids, positions, context = runner.prepare_decode(out.seqs)
    eager = runner.run_model(input_ids, positions, context, None)
    assert graphs.can_replay(3, context) and not graphs.can_replay(21, context)
    wide = Context(attn_metadata=TorchMetadata(block_tables=torch.zeros(3, 9, dtype=torch.int32)))
    assert not graphs.can_replay(3, wide)  # a block table wider than the buffers: eager
    with torch.inference_mode():
        hidden = graphs.replay(input_ids, positions, context)
        replayed = runner.model.compute_logits(hidden)
    assert [g.replays for g in captures] == [0, 0, 0, 1, 0, 0]  # the bucket of 4 served 3 rows
    assert hidden.shape[0] == 3 and hidden.data_ptr() == graphs.buffers.outputs.data_ptr()
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    graphs.free()
    assert graphs.graphs == {} and graphs.buffers is None
    engine.exit()
