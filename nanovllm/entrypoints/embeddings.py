"""POST /v1/embeddings (OpenAI's API): `input` as a string, a list of strings, token ids or lists of
token ids; `encoding_format` float or base64 (little-endian float32, as OpenAI sends it);
`dimensions` only as the model's own size. Each prompt's final hidden states pooled and
L2-normalised (LLM.embed), computed on the engine thread between steps; bounded like the other
routes (--max-prompts inputs, max_model_len tokens each), checked before any forward runs."""
import base64
from collections.abc import Callable
from typing import Literal

import numpy as np
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from nanovllm.entrypoints.async_engine import AsyncEngine, EngineStoppedError
from nanovllm.entrypoints.limits import ServerLimits
from nanovllm.entrypoints.lora_routes import checked_adapter
from nanovllm.entrypoints.protocol import ApiError, TokenIds, error_responses
from nanovllm.entrypoints.tokenization import prepared
from nanovllm.lora.slots import LoRASlotsBusy


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | TokenIds | list[str] | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    def prompts(self) -> list:
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]
        if not self.input:
            raise ApiError(400, "input is empty", param="input")
        return list(self.input)


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


def add_embedding_routes(app: FastAPI, engine: AsyncEngine, served_model_name: str, limits: ServerLimits,
                         check_model: Callable[[str | None], object]) -> None:
    hidden_size = engine.llm.config.hf_config.hidden_size

    @app.post("/v1/embeddings", responses=error_responses(400, 401, 404, 413, 503))
    async def embeddings(body: EmbeddingRequest) -> dict:
        lora = check_model(body.model)  # an adapter's name: its embeddings
        prompts = body.prompts()
        if len(prompts) > limits.max_prompts:
            raise ApiError(400, f"input has {len(prompts)} items; this server takes at most {limits.max_prompts} "
                           "per request (--max-prompts)", param="input")
        if body.dimensions is not None and body.dimensions != hidden_size:
            raise ApiError(400, f"dimensions must be this model's size ({hidden_size}) or unset, got "
                           f"{body.dimensions}", param="dimensions")
        token_lists = await prepared(engine, lambda llm: [llm.tokenize(p) for p in prompts])
        await checked_adapter(engine, lora)

        def embed(llm):
            return llm.embed(token_lists, lora_request=lora)
        try:
            vectors = await engine.call(embed)
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e), param="input") from e
        except LoRASlotsBusy as e:
            raise ApiError(503, str(e), "server_error") from e
        except EngineStoppedError as e:
            raise ApiError(503, str(e), "server_error") from e
        used = sum(map(len, token_lists))
        return {"object": "list", "model": served_model_name if lora is None else lora.lora_name,
                "data": [{"object": "embedding", "index": i, "embedding": encode(v, body.encoding_format)}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": used, "total_tokens": used}}
