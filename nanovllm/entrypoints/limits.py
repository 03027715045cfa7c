"""Bounds on the work one HTTP request may ask for, each checked in O(1) before anything is queued.

openai_server.py holds one ServerLimits (from `nanovllm serve`'s flags), runs check_request on every
generation request, check_context_length once its prompts are tokenized, and wraps the app in
BodySizeLimit, which refuses an oversized body before (or while) reading it.
"""
from dataclasses import dataclass, fields

from fastapi.responses import JSONResponse

from nanovllm.entrypoints.anthropic_errors import error_response, is_messages_path
from nanovllm.entrypoints.protocol import MAX_LOGPROBS, ApiError, error_body
from nanovllm.sampling_params import MAX_N


@dataclass(frozen=True)
class ServerLimits:
    """max_n: completions per prompt (n, best_of). max_prompts: prompts in one request, and also
    completions in one request (prompts x n). max_body_bytes: size of a request body."""

    max_n: int = 128
    max_prompts: int = 1024
    max_body_bytes: int = 8 * 2**20

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be an int >= 1, got {value!r}")
        if self.max_n > MAX_N:
            raise ValueError(f"max_n must be <= {MAX_N} (SamplingParams' own cap), got {self.max_n}")


def check_request(body, num_prompts: int, limits: ServerLimits) -> None:
    """Raise a 400 naming the field and the limit when a generation request asks for too much."""
    for name in ("n", "best_of"):
        value = getattr(body, name, None)
        if value is not None and value > limits.max_n:
            raise ApiError(400, f"{name} must be <= {limits.max_n} (this server's --max-n), got {value}", param=name)
    if num_prompts > limits.max_prompts:
        raise ApiError(400, f"prompt holds {num_prompts} prompts; this server takes at most "
                            f"{limits.max_prompts} per request (--max-prompts)", param="prompt")
    if num_prompts * body.n > limits.max_prompts:
        raise ApiError(400, f"{num_prompts} prompts x n={body.n} make {num_prompts * body.n} completions; "
                            f"this server makes at most {limits.max_prompts} per request (--max-prompts)", param="n")
    name = "top_logprobs" if hasattr(body, "top_logprobs") else "logprobs"
    value = getattr(body, name)
    if isinstance(value, int) and not isinstance(value, bool) and value > MAX_LOGPROBS:
        raise ApiError(400, f"{name} must be <= {MAX_LOGPROBS}, got {value}", param=name)


def check_context_length(prompt_lens: list[int], max_tokens: int | None, max_model_len: int,
                         prompt_param: str = "prompt", param: str = "max_tokens") -> None:
    """Every prompt plus max_tokens must fit in max_model_len (vLLM's 400 and its message)."""
    longest = max(prompt_lens)
    if longest >= max_model_len:
        raise ApiError(400, f"This model's maximum context length (max_model_len) is {max_model_len} "
                            f"tokens. However, your request has {longest} input tokens. Please reduce the "
                            "length of the input.", param=prompt_param)
    if max_tokens is not None and longest + max_tokens > max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {longest + max_tokens} tokens ({longest} in the messages, {max_tokens} "
                            "in the completion). Please reduce the length of the messages or completion.",
                       param=param)


class BodySizeLimit:
    """ASGI middleware: a request body over max_bytes gets a 413, from its Content-Length before
    any of it is read, or as soon as the bytes read pass the limit (chunked uploads)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        # NOTE: the body is read here, bounded, and replayed to the app; the app's later
        # receive() calls (its disconnect watch) go to the connection as before.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left mid-body
                await self.app(scope, _replay([message], receive), send)
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)

    async def _refuse(self, scope, receive, send) -> None:
        message = f"request body is larger than this server's limit of {self.max_bytes} bytes"
        # Connection: close, so the unread rest of the body is never parsed as a next request.
        if is_messages_path(scope["path"]):
            response = error_response(413, message, {"connection": "close"})
        else:
            response = JSONResponse(error_body(message, param="body", code="request_too_large"), status_code=413,
                                    headers={"connection": "close"})
        await response(scope, receive, send)


def _replay(messages: list[dict], receive):
    async def replayed_receive() -> dict:
        return messages.pop(0) if messages else await receive()
    return replayed_receive
