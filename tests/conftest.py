"""Shared fixtures: tiny random checkpoints (made once per session) and engines over them."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

from helpers import make_qwen3  # noqa: E402


@pytest.fixture(scope="session")
def qwen3_gqa(tmp_path_factory) -> str:
    return make_qwen3(str(tmp_path_factory.mktemp("qwen3_gqa")), shape="gqa", seed=1)


@pytest.fixture(scope="session")
def qwen3_bias_tied(tmp_path_factory) -> str:
    return make_qwen3(str(tmp_path_factory.mktemp("qwen3_bias_tied")), shape="bias_tied", seed=2)
