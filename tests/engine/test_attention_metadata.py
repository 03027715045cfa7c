"""Each attention backend's step metadata, built by prepare() from a scheduled batch, against hand
counts; and its CUDA-graph hooks (static tensors, padding rows, the captured bound) on CPU.

flash and triton are built without their __init__ (which imports flash-attn / the Triton kernels):
prepare() and the graph hooks use neither, so their metadata is checked on any machine."""
import pytest
import torch

from nanovllm.layers.backends import AttentionBackend, AttentionBatch
from nanovllm.layers.backends.flash_backend import FlashBackend
from nanovllm.layers.backends.kv_formats import kv_format
from nanovllm.layers.backends.torch_backend import TorchBackend
from nanovllm.layers.backends.triton_backend import TritonBackend

BACKENDS = [TorchBackend, FlashBackend, TritonBackend]


def bare(cls: type[AttentionBackend]) -> AttentionBackend:
    backend = cls.__new__(cls)
    AttentionBackend.__init__(backend, "cpu")
    return backend


def host(t: torch.Tensor) -> torch.Tensor:
    return t


# Three sequences: 4 new of 4 (no prefix), 3 new after 5 cached, 1 new after 19 cached (block 16).
PREFILL = AttentionBatch(True, [4, 3, 1], [4, 8, 20], [[7], [2], [5, 9]], host)
DECODE = AttentionBatch(False, [1, 1, 1], [6, 22, 7], [[2], [0, 1], [4]], host)


def test_batch_helpers_match_hand_counts():
    assert PREFILL.has_cached_prefix and not AttentionBatch(True, [4, 2], [4, 2], [[1], [2]], host).has_cached_prefix
    cu_q, cu_k = PREFILL.cu_seqlens()
    assert cu_q.tolist() == [0, 4, 7, 8] and cu_k.tolist() == [0, 4, 12, 32] and cu_q.dtype == torch.int32
    table = PREFILL.block_table_tensor()
    assert table.tolist() == [[7, -1], [2, -1], [5, 9]] and table.dtype == torch.int32
    assert DECODE.context_lens_tensor().tolist() == [6, 22, 7]


@pytest.mark.parametrize("cls", BACKENDS)
def test_every_metadata_tensor_comes_from_to_device(cls):
    """The runner's host->device copy is the only way a tensor gets into the metadata."""
    returned = []

    def to_device(t):
        returned.append(t.clone())
        return returned[-1]

    for batch in (AttentionBatch(True, [3], [8], [[1]], to_device), AttentionBatch(False, [1], [8], [[1]], to_device)):
        meta = bare(cls).prepare(batch)
        tensors = [v for v in vars(meta).values() if isinstance(v, torch.Tensor)]
        assert tensors and all(any(t is r for r in returned) for t in tensors)


def torch_backend(kv_format=None, cpu_kernel=None) -> TorchBackend:
    backend = bare(TorchBackend)
    backend.cpu_kernel = cpu_kernel
    if kv_format is not None:
        backend.kv_format = kv_format
    return backend


def test_torch_metadata_keeps_host_lists():
    prefill = torch_backend().prepare(PREFILL)
    assert prefill.seqlens_q == [4, 3, 1] and prefill.seqlens_k == [4, 8, 20]
    assert prefill.block_tables.tolist() == [[7, -1], [2, -1], [5, 9]]
    fresh_batch = AttentionBatch(True, [4, 2], [4, 2], [[1], [2]], host)
    fresh = torch_backend().prepare(fresh_batch)
    assert fresh.block_tables is None  # no cached prefix: the fresh K/V are all it reads
    # the C int8 prefill reads every key from the cache, so its metadata always has the tables
    int8 = torch_backend(kv_format("int8"), cpu_kernel=object())
    assert int8.prefill_in_c() and int8.prepare(fresh_batch).block_tables.tolist() == [[1], [2]]
    decode = torch_backend().prepare(DECODE)
    assert decode.seqlens_k == [6, 22, 7] and decode.max_seqlen_k == 22 and decode.decode_groups is None


@pytest.mark.parametrize("cls", [FlashBackend, TritonBackend])
def test_device_backends_prefill_metadata(cls):
    meta = bare(cls).prepare(PREFILL)
    assert meta.cu_seqlens_q.tolist() == [0, 4, 7, 8] and meta.cu_seqlens_k.tolist() == [0, 4, 12, 32]
    assert meta.max_seqlen_q == 4 and meta.max_seqlen_k == 20
    table = meta.block_tables
    assert table.tolist() == [[7, -1], [2, -1], [5, 9]]
    fresh = bare(cls).prepare(AttentionBatch(True, [4, 2], [4, 2], [[1], [2]], host))
    assert fresh.block_tables is None


@pytest.mark.parametrize("cls", BACKENDS)
def test_decode_metadata(cls):
    meta = bare(cls).prepare(DECODE)
    tables, lens = bare(cls).decode_tensors(meta)
    assert tables.tolist() == [[2, -1], [0, 1], [4, -1]] and lens.tolist() == [6, 22, 7]
    assert lens.dtype == torch.int32 and meta.max_seqlen_k == 22


@pytest.mark.parametrize("cls", BACKENDS)
def test_graph_hooks_fill_static_views_and_pad(cls):
    """The metadata a graph is captured with views the static tensors (a replay reads the addresses
    seen at capture), carries the bound max_seqlen_k, and holds a live batch after a fill, with
    padding rows that attend to one key of block 0."""
    backend = bare(cls)
    backend.init_graph_buffers(8, 4, max_seqlen_k=128, device="cpu")
    captured = backend.graph_metadata(4)
    tables, lens = backend.decode_tensors(captured)
    assert tables.shape == (4, 4) and lens.shape == (4,) and captured.max_seqlen_k == 128
    assert tables.data_ptr() == backend.graph_tables.block_tables.data_ptr()
    assert lens.data_ptr() == backend.graph_tables.context_lens.data_ptr()
    live = backend.prepare(DECODE)
    assert backend.fits_graph_buffers(live)
    backend.fill_graph_buffers(live, graph_bs=4)
    assert tables.tolist() == [[2, -1, -1, -1], [0, 1, -1, -1], [4, -1, -1, -1], [0, 0, 0, 0]]
    assert lens.tolist() == [6, 22, 7, 1]
    wide = backend.prepare(AttentionBatch(False, [1], [80], [list(range(5))], host))
    assert not backend.fits_graph_buffers(wide)  # 5 blocks > the 4 the buffers hold
    if cls is TorchBackend:
        assert captured.seqlens_k is None  # no host lists under a graph: the padded path runs


def test_torch_backend_under_graph_metadata_matches_eager():
    """The torch backend's decode over graph metadata (padded rows, fixed-width table) gives the
    eager decode's rows."""
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(6, 16, 2, 8), torch.randn(6, 16, 2, 8)
    q = torch.randn(3, 4, 8)
    backend = TorchBackend("cpu")
    backend.cpu_kernel = None
    eager = backend.decode(q, k_cache, v_cache, backend.prepare(DECODE), 0.3)
    backend.init_graph_buffers(8, 4, max_seqlen_k=64, device="cpu")
    backend.fill_graph_buffers(backend.prepare(DECODE), graph_bs=4)
    padded_q = torch.cat([q, torch.zeros(1, 4, 8)])
    graphed = backend.decode(padded_q, k_cache, v_cache, backend.graph_metadata(4), 0.3)
    torch.testing.assert_close(graphed[:3], eager, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(graphed[3]).all()  # the padding row reads a real block
