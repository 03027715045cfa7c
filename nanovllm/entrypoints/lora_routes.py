"""Adapters in the server, as vLLM serves them: `--lora-modules name=path` (or vLLM's JSON form), each
adapter a `model` of its own in every API (its `parent` in /v1/models the base model), and, where
VLLM_ALLOW_RUNTIME_LORA_UPDATING is true, POST /v1/load_lora_adapter and /v1/unload_lora_adapter.
An adapter is read and checked off the engine thread (the preparation thread) before it is listed,
so a load never stalls the steps of running requests."""
import json
import os
import threading

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from nanovllm.entrypoints.async_engine import AsyncEngine
from nanovllm.entrypoints.protocol import ApiError
from nanovllm.lora.request import LoRARequest

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def parse_lora_module(text: str) -> tuple[str, str, str | None]:
    """(name, path, base model name) of one --lora-modules value: name=path, or vLLM's JSON object
    {"name": ..., "path": ..., "base_model_name": ...}; ValueError naming the value otherwise."""
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--lora-modules {text!r}: not valid JSON ({e})") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not isinstance(entry.get("path"), str):
            raise ValueError(f"--lora-modules {text!r}: a JSON entry needs string fields name and path")
        base = entry.get("base_model_name")
        return entry["name"], entry["path"], base if isinstance(base, str) else None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path (or a JSON object with name and path)")
    return name, path, None


def lora_module_requests(values: list[str] | None) -> tuple[LoRARequest, ...]:
    """--lora-modules' values as requests (ids 1, 2, ...); ValueError naming a bad or repeated one."""
    requests: list[LoRARequest] = []
    for text in values or ():
        name, path, base = parse_lora_module(text)
        if any(r.lora_name == name for r in requests):
            raise ValueError(f"--lora-modules names {name!r} twice")
        requests.append(LoRARequest(name, len(requests) + 1, path, base))
    return tuple(requests)


class ServedModels:
    """The names requests may give as `model`: the base model (and its aliases), then each adapter."""

    def __init__(self, served_model_name: str, aliases: tuple[str, ...] = ()):
        self.served_model_name = served_model_name
        self.base_names = frozenset((served_model_name, *aliases))
        self.adapters: dict[str, LoRARequest] = {}
        self._next_id = 1
        self._lock = threading.Lock()

    def new_request(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        if name in self.base_names:
            raise ValueError(f"adapter name {name!r} is the base model's name")
        with self._lock:
            self._next_id += 1
            return LoRARequest(name, self._next_id - 1, path, base_model_name)

    def add(self, request: LoRARequest) -> None:
        with self._lock:
            if request.lora_name in self.adapters or request.lora_name in self.base_names:
                raise ValueError(f"the LoRA adapter {request.lora_name!r} has already been loaded")
            self.adapters[request.lora_name] = request
            self._next_id = max(self._next_id, request.lora_int_id + 1)

    def remove(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self.adapters.pop(name, None)

    def resolve(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for a name not served."""
        if name is None or name in self.base_names:
            return None
        request = self.adapters.get(name)
        if request is None:  # OpenAI's and vLLM's answer: 404, model_not_found
            served = [self.served_model_name, *self.adapters]
            raise ApiError(404, f"model {name!r} does not exist; this server serves {served}", param="model",
                           code="model_not_found")
        return request

    def cards(self, created: int, max_model_len: int) -> list[dict]:
        base = {"id": self.served_model_name, "object": "model", "created": created, "owned_by": "nanovllm",
                "root": self.served_model_name, "parent": None, "max_model_len": max_model_len}
        adapters = [{"id": r.lora_name, "object": "model", "created": created, "owned_by": "nanovllm",
                     "root": r.lora_path, "parent": r.base_model_name or self.served_model_name,
                     "max_model_len": max_model_len} for r in list(self.adapters.values())]
        return [base, *adapters]


async def checked_adapter(engine: AsyncEngine, request: LoRARequest | None) -> None:
    """Read and check the adapter on the preparation thread (kept among the host's recent adapters), so
    the engine thread finds it there; a bad adapter is a 400."""
    if request is None:
        return
    try:
        await engine.prepare(lambda llm: llm.llm_engine.processor.lora_adapter(request))
    except (ValueError, TypeError) as e:
        raise ApiError(400, str(e), param="model") from e


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATES_ENV, "").strip().lower() in ("1", "true")


def add_lora_routes(app: FastAPI, engine: AsyncEngine, models: ServedModels) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter, only where runtime updates are allowed
    (vLLM's gate: the routes do not exist otherwise)."""
    if not runtime_updates_allowed():
        return
    if not engine.llm.config.enable_lora:
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> str:
        try:
            request = models.new_request(body.lora_name, body.lora_path, body.base_model_name)
        except ValueError as e:
            raise ApiError(400, str(e), param="lora_name") from e
        if body.lora_name in models.adapters:
            raise ApiError(400, f"the LoRA adapter {body.lora_name!r} has already been loaded", param="lora_name")
        await checked_adapter(engine, request)
        try:
            models.add(request)
        except ValueError as e:
            raise ApiError(400, str(e), param="lora_name") from e
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> str:
        request = models.remove(body.lora_name)
        if request is None:
            raise ApiError(404, f"the LoRA adapter {body.lora_name!r} cannot be found", param="lora_name",
                           code="model_not_found")
        # Requests already queued with it finish with it; its host copy and idle slot go now.
        await engine.call(lambda llm: llm.llm_engine.forget_lora(request))
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
