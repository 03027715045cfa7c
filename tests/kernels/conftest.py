"""Fixtures of the kernel tests."""
import pytest

from nanovllm.kernels import cpu_kernels


@pytest.fixture(scope="module")
def kernels():
    """The CPU C kernels' library, built on first use; the test is skipped without a C compiler."""
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no C compiler")
    return kernels
