"""Schemathesis hooks for fuzzing `nanovllm serve`: generated bodies ask for the served model.

Loaded by tests/server/test_schemathesis.py and, through SCHEMATHESIS_HOOKS, by scripts/check_schemathesis.sh.
The served name comes from NANOVLLM_SERVED_MODEL.
"""
import json
import os
import zlib

import schemathesis


@schemathesis.hook
def map_case(context, case):
    """A random string in `model` is always 404 model_not_found (documented and checked once here by
    the cases left alone), which would stop every request before the fields behind it. A string
    model becomes the served one; a model of the wrong type stays, so negative cases stay negative."""
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("model"), str) and not _keep_wrong_model(body):
        body["model"] = os.environ.get("NANOVLLM_SERVED_MODEL", "tiny-qwen3")
    return case


def _keep_wrong_model(body: dict) -> bool:
    # One body in about sixteen keeps its random model, so the 404 path is fuzzed too. NOTE: a hash
    # of the whole body, not of the model alone: the coverage phase sends "" as the model many times.
    return zlib.crc32(json.dumps(body, sort_keys=True, default=repr).encode()) % 16 == 0
