"""Each platform's decisions against hand-written expectations (names, defaults, dtype, device of a
rank, dist backend, draw function, zeroed KV cache), and the CPU platform's weight processing
against plain F.linear."""
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nanovllm.config import Config
from nanovllm.kernels import cpu_kernels
from nanovllm.layers.embed_head import ParallelLMHead
from nanovllm.layers.linear import QKVParallelLinear, RowParallelLinear
from nanovllm.layers.quantization import UnquantizedLinearMethod
from nanovllm.platforms import CpuPlatform, CudaPlatform, get_platform
from nanovllm.platforms import cpu as cpu_platform
from nanovllm.executor.model_runner import linear_kernels, process_weights
from nanovllm.sample.sampler import RANDOM_SAMPLES, exponential_race_sample, inverse_cdf_sample


# ---- choosing a platform ----------------------------------------------------------------------
def test_get_platform_resolves_names(monkeypatch):
    assert type(get_platform("cpu")) is CpuPlatform
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert type(get_platform("auto")) is CpuPlatform
    with pytest.raises(ValueError, match="device='cuda' was asked for but torch sees no CUDA device"):
        get_platform("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert type(get_platform("auto")) is CudaPlatform
    assert type(get_platform("cuda")) is CudaPlatform
    with pytest.raises(ValueError, match="device must be one of"):
        get_platform("tpu")


def test_config_holds_its_platform_through_pickling(qwen3_gqa):
    config = Config(qwen3_gqa, device="cpu")
    assert type(config.platform) is CpuPlatform and config.device == "cpu"
    assert "platform" not in repr(config)
    # TP workers receive the Config pickled (spawn).
    copy = pickle.loads(pickle.dumps(config))
    assert type(copy.platform) is CpuPlatform
    assert (copy.device, copy.kvcache_block_size, copy.torch_dtype) == (config.device, 16, config.torch_dtype)


# ---- the CPU platform -------------------------------------------------------------------------
def test_cpu_platform_decisions(qwen3_gqa):
    p = CpuPlatform()
    assert (p.device_name, p.dist_backend, p.default_block_size, p.has_decode_graphs) == ("cpu", "gloo", 16, False)
    assert p.device_of_rank(0) == p.device_of_rank(3) == torch.device("cpu")
    assert p.default_compile_ops(enforce_eager=False) is False
    assert RANDOM_SAMPLES[p.random_sample] is inverse_cdf_sample
    t = torch.arange(4)
    assert p.to_device(t, torch.device("cpu")) is t  # no copy on the host
    config = Config(qwen3_gqa, device="cpu", cpu_kvcache_bytes=12345)
    assert (config.kvcache_block_size, config.compile_ops) == (16, False)
    assert p.default_max_num_batched_tokens == config.max_num_batched_tokens == 8192  # the prefill chunk
    assert Config(qwen3_gqa, device="cpu", max_num_batched_tokens=300).max_num_batched_tokens == 300
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Config(qwen3_gqa, device="cpu", max_num_batched_tokens=0)
    budget = p.kv_cache_budget_bytes(torch.device("cpu"), lambda: pytest.fail("no warm-up on CPU"),
                                     config.cpu_kvcache_bytes, config.gpu_memory_utilization)
    assert budget == 12345


def test_cpu_kv_budget_is_a_capped_share_of_free_ram_per_rank(monkeypatch):
    monkeypatch.setattr(cpu_platform, "available_ram_bytes", lambda: 16 << 30)
    assert CpuPlatform().default_kvcache_bytes(1) == 4 << 30   # a quarter
    assert CpuPlatform().default_kvcache_bytes(2) == 2 << 30   # split over the ranks
    monkeypatch.setattr(cpu_platform, "available_ram_bytes", lambda: 64 << 30)
    assert CpuPlatform().default_kvcache_bytes(1) == 8 << 30   # capped


@pytest.mark.parametrize("flags", ["flags\t\t: fpu avx2 avx512_bf16\n", "flags\t\t: fpu amx_bf16 amx_tile\n",
                                   "flags\t\t: fpu avx2 fma\n", ""])
def test_cpu_auto_dtype_is_fp32_whatever_the_cpu(monkeypatch, flags):
    # Measured: bf16 slower than fp32 end to end even with AVX512-BF16 (docs/performance.md, "fp32 activations on a CPU").
    monkeypatch.setattr("nanovllm.utils.cpu_info.cpu_flags_line", lambda: flags)
    p = CpuPlatform()
    for checkpoint_dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert p.resolve_auto_dtype(checkpoint_dtype) == torch.float32


def test_cpu_triton_backend_needs_the_interpreter(monkeypatch):
    # The rule lives with the triton backend; Config asks it through check_backend_name.
    pytest.importorskip("triton")
    from nanovllm.layers.backends import check_backend_name
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        check_backend_name("triton", "cpu")
    check_backend_name("torch", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_backend_name("triton", "cpu")


def test_cpu_rank_gets_its_share_of_the_cores():
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    old = torch.get_num_threads()
    try:
        CpuPlatform().set_up_rank(1, 2)
        assert torch.get_num_threads() == max(1, cores // 2)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kv_cache_is_zeroed_and_writable(dtype):
    shape = (2, 3, 5, 16, 2, 8)
    cache = CpuPlatform().allocate_kv_cache(shape, dtype, torch.device("cpu"))
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert not cache.any()
    cache[1, 2, 4, 15, 1, 7] = 3.0
    assert cache.sum().item() == 3.0 and cache.view(-1)[-1].item() == 3.0


def huge_pages_advised() -> bool:
    """Whether this kernel gives an madvise(MADV_HUGEPAGE) region transparent huge pages."""
    from pathlib import Path
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return setting.is_file() and ("[always]" in setting.read_text() or "[madvise]" in setting.read_text())


def anon_huge_kib() -> int:
    from pathlib import Path
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kv_cache_prefault_maps_every_page_up_front(dtype):
    """Writing one value into every page of a 16 MiB cache: without prefault the writes fault pages
    in (one per 4 KiB page, or per 2 MiB huge page), with it none are left to take."""
    import mmap
    import resource
    shape = (2, 4, 8, 256, 2, 64)
    nbytes = 2 * 4 * 8 * 256 * 2 * 64 * dtype.itemsize
    pages = nbytes // mmap.PAGESIZE
    faults = {}
    for prefault in (False, True):
        cache = CpuPlatform().allocate_kv_cache(shape, dtype, torch.device("cpu"), prefault=prefault)
        assert not cache.any() if prefault else True  # (reading a lazy cache would map it: not here)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cache.view(-1)[:: mmap.PAGESIZE // dtype.itemsize].fill_(1.0)
        faults[prefault] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert cache.sum().item() == pages
    assert faults[False] >= nbytes // 2**21 and faults[True] < max(2, nbytes // 2**21 // 4), (pages, faults)


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").is_file() or not huge_pages_advised(),
                    reason="no transparent huge pages for madvised memory here")
def test_cpu_kv_cache_is_held_in_huge_pages():
    """A cache whose layers' K and V runs are 64 MiB asks for 2 MiB pages: written, it adds
    AnonHugePages to the process (decode attention streams it; docs/performance.md,
    "The KV cache's memory"). One of 2 MiB runs does not (a page touched in each of its 56 runs would map 112 MiB
    of 4 KiB ones' worth): where huge pages come only when asked for, it adds none."""
    from nanovllm.platforms.cpu import HUGE_PAGE_RUN_BYTES
    before = anon_huge_kib()
    cache = CpuPlatform().allocate_kv_cache((2, 1, HUGE_PAGE_RUN_BYTES // 2), torch.float16, torch.device("cpu"),
                                            prefault=True)
    assert anon_huge_kib() - before >= 16 * 1024, "no huge pages behind the KV cache"
    del cache
    if "[madvise]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        before = anon_huge_kib()
        small = CpuPlatform().allocate_kv_cache((2, 28, 2**20), torch.float16, torch.device("cpu"), prefault=True)
        assert anon_huge_kib() - before < 8 * 1024, "huge pages behind a cache of short runs"
        del small


# ---- the CUDA platform (its decisions need no GPU) ----------------------------------------------
def test_cuda_platform_decisions(monkeypatch):
    p = CudaPlatform()
    assert (p.device_name, p.dist_backend, p.default_block_size, p.has_decode_graphs) == ("cuda", "nccl", 256, True)
    assert p.default_max_num_batched_tokens == 16384
    assert p.device_of_rank(0) == torch.device("cuda", 0) and p.device_of_rank(3) == torch.device("cuda", 3)
    assert p.default_compile_ops(enforce_eager=False) is True
    assert p.default_compile_ops(enforce_eager=True) is False
    assert RANDOM_SAMPLES[p.random_sample] is exponential_race_sample
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert p.resolve_auto_dtype(dtype) == dtype  # the checkpoint's
    assert p.default_kvcache_bytes(1) is None  # measured after the warm-up instead
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    p.check_tensor_parallel_size(2)
    with pytest.raises(ValueError, match="exceeds the 2 visible CUDA"):
        p.check_tensor_parallel_size(4)


@pytest.mark.gpu
def test_cuda_kv_cache_is_zeroed_and_copies_arrive():
    p, device = CudaPlatform(), torch.device("cuda", 0)
    cache = p.allocate_kv_cache((2, 2, 3, 256, 2, 8), torch.bfloat16, device)
    assert cache.device == device and not cache.any()
    t = p.to_device(torch.arange(5), device)
    p.synchronize(device)
    assert t.device == device and t.tolist() == [0, 1, 2, 3, 4]


# ---- the CPU platform's weight processing -----------------------------------------------------
def small_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.qkv = QKVParallelLinear(32, head_size=8, total_num_heads=4, total_num_kv_heads=2, bias=True)  # 32 -> 64
    model.down = RowParallelLinear(48, 32, bias=True)  # narrower output than input
    model.head = ParallelLMHead(100, 32)
    for p in model.parameters():
        p.data.normal_()
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_weight_processing_matches_f_linear(dtype):
    model = small_model(dtype)
    dense = {name: p.detach().clone() for name, p in model.named_parameters()}
    layers = {"qkv": model.qkv, "down": model.down, "head": model.head}
    assert all(type(m.quant_method) is UnquantizedLinearMethod and m.quant_method.kernel == "dense"
               for m in layers.values())
    platform = CpuPlatform()
    described = process_weights(model, platform, linear_kernels(platform, dtype))
    if dtype == torch.float32 and cpu_platform.can_pack_weights(dtype):
        # held once, dense: the C kernel wherever the kernels build (oneDNN-packed where they do not)
        kernel = "c" if cpu_kernels.load() is not None else "packed"
        expected = {name: kernel for name in layers}
    else:
        # MKL, transposed where the output is at least as wide as the input
        expected = {"qkv": "transposed", "down": "dense", "head": "transposed"}
    assert {name: m.quant_method.kernel for name, m in layers.items()} == expected
    if expected["qkv"] == "c":
        assert described == "dense fp32: C kernel at every row count"
        # one copy: the loaded weight itself, nothing packed beside it
        assert all(m.weight.data_ptr() == m.quant_method.c_linear.data and not hasattr(m, "packed_weight")
                   for m in layers.values())
    else:
        names = {"packed": "oneDNN-packed", "transposed": "transposed", "dense": "dense"}
        assert described == ", ".join(sorted({names[kernel] for kernel in expected.values()}))
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-1)
    for rows in (1, 3, 16, 17, 33, 70):  # the C kernels' tiles and their outer-product path
        x, h = torch.randn(rows, 32, dtype=dtype), torch.randn(rows, 48, dtype=dtype)
        torch.testing.assert_close(model.qkv(x), F.linear(x, dense["qkv.weight"], dense["qkv.bias"]), **tol)
        torch.testing.assert_close(model.down(h), F.linear(h, dense["down.weight"], dense["down.bias"]), **tol)
        torch.testing.assert_close(model.head(x), F.linear(x, dense["head.weight"]), **tol)
