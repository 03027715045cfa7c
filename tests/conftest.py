"""Shared pytest setup: `gpu` tests are skipped without CUDA; Triton kernels run in the interpreter
on CPU-only machines."""
import os

import pytest
import torch

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
