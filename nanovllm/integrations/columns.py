"""One Ray Data batch as the predictor of integrations/ray.py reads and writes it: the prompt column,
the per-row sampling columns, and the output columns added beside the input ones. Needs numpy only."""
import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from nanovllm.sampling_params import SamplingParams

PROMPT_COLUMNS = ("prompt", "prompt_token_ids")
OUTPUT_COLUMNS = ("generated_text", "generated_token_ids", "num_prompt_tokens", "num_generated_tokens",
                  "finish_reason")
SAMPLING_DICT_COLUMN = "sampling_params"
# One row in, one row out: n > 1 would make several outputs per row and logprobs a column of its own.
SAMPLING_COLUMNS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name not in ("n", "logprobs"))
# Integer fields also take whole-number floats: pandas turns an int column with gaps into floats.
INT_FIELDS = frozenset({"max_tokens", "min_tokens", "seed", "top_k"})


def read_batch(batch) -> dict:
    """Ray's batch formats (a dict of numpy arrays, a pandas DataFrame, a pyarrow Table) as a dict
    of equally long column sequences."""
    module = type(batch).__module__
    if isinstance(batch, Mapping):
        columns = dict(batch)
    elif module.startswith("pandas"):
        columns = {str(name): batch[name].to_numpy() for name in batch.columns}
    elif module.startswith("pyarrow"):
        columns = {name: batch.column(name).to_numpy(zero_copy_only=False) for name in batch.column_names}
    else:
        raise TypeError(f"batch must be a dict of numpy arrays, a pandas DataFrame or a pyarrow Table, "
                        f"got {type(batch).__name__}")
    lengths = {name: len(values) for name, values in columns.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"batch columns differ in length: {lengths}")
    clash = [name for name in OUTPUT_COLUMNS if name in columns]
    if clash:
        raise ValueError(f"batch already has output column(s) {clash}; rename them (they would be overwritten)")
    return columns


def num_rows(columns: dict) -> int:
    return len(next(iter(columns.values()))) if columns else 0


def is_missing(value) -> bool:
    """None, NaN and pandas' NA: what columnar formats put where a row has no value."""
    return (value is None or (isinstance(value, float) and math.isnan(value))
            or type(value).__name__ == "NAType")


def read_prompts(columns: dict, n: int) -> list[str | list[int]]:
    """Each row's prompt: text from `prompt` or token ids from `prompt_token_ids` (a batch may hold
    both columns, as a JSONL file mixing the two gives, if each row sets exactly one)."""
    present = [name for name in PROMPT_COLUMNS if name in columns]
    if not present:
        raise ValueError(f"batch has no 'prompt' (text) or 'prompt_token_ids' (token ids) column; "
                         f"its columns: {sorted(columns)}")
    prompts = []
    for row in range(n):
        given = [name for name in present if not is_missing(columns[name][row])]
        if len(given) != 1:
            what = "both" if given else "neither"
            raise ValueError(f"row {row}: exactly one of the columns 'prompt' and 'prompt_token_ids' must "
                             f"be set, got {what}")
        value = columns[given[0]][row]
        prompts.append(as_text(value, row) if given[0] == "prompt" else as_token_ids(value, row))
    return prompts


def as_text(value, row: int) -> str:
    if not isinstance(value, str):
        raise ValueError(f"row {row}: column 'prompt' must hold strings, got {type(value).__name__} {value!r:.60}")
    if not value:
        raise ValueError(f"row {row}: column 'prompt' is an empty string")
    return str(value)


def as_token_ids(value, row: int) -> list[int]:
    """A list of ints from a numpy int array (Ray's form of a list column) or a list/tuple of ints."""
    where = f"row {row}: column 'prompt_token_ids'"
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise ValueError(f"{where} must hold 1-D lists of ints, got an array of {value.dtype} "
                             f"with shape {value.shape}")
        ids = value.tolist()
    elif isinstance(value, (list, tuple)):
        bad = [t for t in value if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
        if bad:
            raise ValueError(f"{where} must hold lists of ints, got items {bad[:4]!r}")
        ids = [int(t) for t in value]
    else:
        raise ValueError(f"{where} must hold lists of ints, got {type(value).__name__} {value!r:.60}")
    if not ids:
        raise ValueError(f"{where} is an empty list")
    return ids


def as_field_value(name: str, value):
    """A column value as SamplingParams takes it: Python scalars and lists, not numpy ones."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    elif isinstance(value, np.generic):
        value = value.item()
    if name in INT_FIELDS and isinstance(value, float) and value.is_integer():
        value = int(value)
    return value


def row_overrides(columns: dict, row: int) -> dict[str, tuple[str, object]]:
    """The sampling fields this row sets: field -> (the column it came from, its value).
    A missing value (None, NaN) leaves the field at the predictor's default."""
    found = {}
    if SAMPLING_DICT_COLUMN in columns and not is_missing(options := columns[SAMPLING_DICT_COLUMN][row]):
        if not isinstance(options, Mapping):
            raise ValueError(f"row {row}: column 'sampling_params' must hold dicts of SamplingParams fields, "
                             f"got {type(options).__name__} {options!r:.60}")
        unknown = sorted(set(options) - set(SAMPLING_COLUMNS))
        if unknown:
            raise ValueError(f"row {row}: column 'sampling_params' has unknown field(s) {unknown}; "
                             f"known: {list(SAMPLING_COLUMNS)}")
        found = {k: (SAMPLING_DICT_COLUMN, v) for k, v in options.items() if not is_missing(v)}
    for name in SAMPLING_COLUMNS:
        if name in columns and not is_missing(value := columns[name][row]):
            if name in found:
                raise ValueError(f"row {row}: {name} is set both by column {name!r} and in 'sampling_params'")
            found[name] = (name, value)
    return found


def read_sampling_params(columns: dict, n: int, defaults: dict) -> list[SamplingParams]:
    """Each row's SamplingParams: the default fields with the row's sampling columns put over them.
    NOTE: `defaults` are the fields as given, not a built SamplingParams, whose greedy normalization
    would drop a default top_p that a row raising the temperature should keep."""
    default = SamplingParams(**defaults)
    if SAMPLING_DICT_COLUMN not in columns and not any(name in columns for name in SAMPLING_COLUMNS):
        return [default] * n
    params = []
    for row in range(n):
        found = row_overrides(columns, row)
        if not found:
            params.append(default)
            continue
        try:
            params.append(SamplingParams(**{**defaults, **{k: as_field_value(k, v) for k, (_, v) in found.items()}}))
        except (TypeError, ValueError) as e:
            sources = sorted({repr(source) for source, _ in found.values()})
            raise ValueError(f"row {row}: bad sampling value in column(s) {', '.join(sources)}: {e}") from e
    return params


def output_columns(outputs: list[dict]) -> dict[str, np.ndarray]:
    """generate()'s outputs as the five output columns (token ids: an object array of int lists)."""
    token_ids = np.empty(len(outputs), dtype=object)
    token_ids[:] = [list(out["token_ids"]) for out in outputs]
    return {
        "generated_text": np.array([out["text"] for out in outputs], dtype=object),
        "generated_token_ids": token_ids,
        "num_prompt_tokens": np.array([len(out["prompt_token_ids"]) for out in outputs], dtype=np.int64),
        "num_generated_tokens": np.array([len(out["token_ids"]) for out in outputs], dtype=np.int64),
        "finish_reason": np.array([out["finish_reason"] for out in outputs], dtype=object),
    }


def write_batch(batch, columns: dict, new_columns: dict[str, np.ndarray]):
    """The input columns with the new ones beside them: a DataFrame for a DataFrame, else a dict
    (Ray takes a dict of arrays back whatever format the batch came in)."""
    if type(batch).__module__.startswith("pandas"):
        import pandas as pd
        return pd.concat([batch, pd.DataFrame(new_columns, index=batch.index)], axis=1)
    return {**columns, **new_columns}
