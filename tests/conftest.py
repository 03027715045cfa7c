"""Shared pytest setup: tiny random checkpoints (made once per session); `gpu` tests are skipped
without CUDA; Triton kernels run in the interpreter on CPU-only machines.

The tests live in folders by the part of the code they test (engine, kernels, layers, models,
server, tools). What several test modules share lives beside this file (helpers.py, gguf_helpers.py,
..., server_fixtures.py) or in a folder's conftest.py: no test module imports another."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import make_qwen3  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA:
    # NOTE: triton reads this when a kernel is defined (module import), so it must be set before
    # any test imports a kernel module; conftest is imported before every test module.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def qwen3_gqa(tmp_path_factory) -> str:
    return make_qwen3(str(tmp_path_factory.mktemp("qwen3_gqa")), shape="gqa", seed=1)


@pytest.fixture(scope="session")
def qwen3_bias_tied(tmp_path_factory) -> str:
    return make_qwen3(str(tmp_path_factory.mktemp("qwen3_bias_tied")), shape="bias_tied", seed=2)



@pytest.fixture(scope="session")
def other_build_cache(tmp_path_factory):
    """One NANOVLLM_CACHE for the builds of other -march settings (x86-64-v3, x86-64) the tests
    run in subprocesses, shared by the session's xdist workers: each library is compiled once per
    session, whichever test asks first (the build's lock file makes the other wait for it)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's own
    path = root / "other_builds"
    path.mkdir(exist_ok=True)
    return path
