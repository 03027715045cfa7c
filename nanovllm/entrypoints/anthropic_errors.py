"""Anthropic's error shape ({"type": "error", "error": {"type", "message"}}) for every answer under
/v1/messages: the Messages routes (anthropic_messages.py), the server's error handlers and API-key
check (openai_server.py) and the body-size limit (limits.py) all use error_response there."""
from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel

PATH = "/v1/messages"
# Anthropic's error types by HTTP status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 500: "api_error", 503: "overloaded_error"}


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error body."""
    type: Literal["error"]
    error: AnthropicErrorInfo


ERRORS = {status: {"model": AnthropicError, "description": kind} for status, kind in ERROR_TYPES.items()}


def is_messages_path(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def error_response(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status,
                        headers=headers)
