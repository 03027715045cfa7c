"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncEngine. Started by `nanovllm serve`
(nanovllm/cli.py) or by tests through build_app() + uvicorn.

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream`), GET /v1/models,
GET /health. Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}.
"""
import asyncio
import hmac
import logging
import time
from contextlib import contextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm.entrypoints.async_engine import AsyncEngine, EngineStepError, EngineStoppedError
from nanovllm.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, error_body
from nanovllm.entrypoints.serving import Generation, completion_response, chat_response, sse_chunks

logger = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


class ApiKeyMiddleware:
    """Plain ASGI middleware (streams pass through untouched): every path but /health needs
    `Authorization: Bearer <api_key>`."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                body = error_body("missing or incorrect API key", "authentication_error", code="invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving one model under `served_model_name`. The engine must be started."""
    app = FastAPI(title="nano-vLLM OpenAI-compatible server")
    app.state.engine = engine
    created = int(time.time())
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.is_running:
            return JSONResponse(error_body("engine loop stopped", "server_error"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": served_model_name, "object": "model", "created": created, "owned_by": "nanovllm",
                "max_model_len": engine.llm.config.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, served_model_name)
        with _as_bad_request():
            body.check_supported()
            prompts, params = body.prompts(), body.sampling_params()
        gen = Generation(engine, engine.new_request_id("cmpl"), served_model_name, params.n, params.logprobs)
        return await _respond(gen, request, body, prompts, params, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(body.model, served_model_name)
        with _as_bad_request():
            body.check_supported()
            params = body.sampling_params()
        gen = Generation(engine, engine.new_request_id("chatcmpl"), served_model_name, params.n,
                         params.logprobs)
        return await _respond(gen, request, body, [body.conversation()], params, "chat")

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI's error body."""

    @app.exception_handler(ApiError)
    async def on_api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body, status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation_body(e), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), type_), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def on_unexpected_error(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)


async def _respond(gen: Generation, request: Request, body, prompts: list, params, kind: str):
    try:
        await gen.submit(prompts, params)
    except (ValueError, TypeError) as e:
        raise ApiError(400, str(e)) from e
    except EngineStoppedError as e:
        raise ApiError(503, str(e), "server_error") from e
    if body.stream:
        # StreamingResponse cancels the stream when the client hangs up, which aborts the requests;
        # the background task catches a hang-up before the stream even started.
        chunks = sse_chunks(gen, kind, body.include_usage)
        return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(gen.abort_unfinished))
    try:
        if not await _finish_unless_disconnected(gen, request):
            return JSONResponse(error_body("client disconnected", "invalid_request_error"), status_code=499)
    except EngineStepError as e:
        raise ApiError(500, str(e), "server_error") from e
    return completion_response(gen) if kind == "completion" else chat_response(gen)


async def _finish_unless_disconnected(gen: Generation, request: Request) -> bool:
    """Wait for the whole generation; False (and the requests aborted) if the client left first.

    NOTE: the body is already read, so the next ASGI message can only be http.disconnect."""
    work = asyncio.ensure_future(gen.run_to_end())
    hang_up = asyncio.ensure_future(request.receive())
    try:
        await asyncio.wait({work, hang_up}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, hang_up):
            task.cancel()  # cancelling the work runs Generation.deltas' abort
    if work.cancelled() or not work.done():
        return False
    work.result()  # re-raises an EngineStepError
    return True


def _check_model(name: str, served_model_name: str) -> None:
    if name != served_model_name:
        raise ApiError(400, f"model {name!r} does not exist; this server serves {served_model_name!r}",
                       param="model", code="model_not_found")


@contextmanager
def _as_bad_request():
    """Turns the ValueError/TypeError of request validation into a 400."""
    try:
        yield
    except (ValueError, TypeError) as e:
        raise ApiError(400, str(e)) from e


def _validation_body(e: RequestValidationError) -> dict:
    """The first few pydantic errors as one message; param names the first bad field."""
    errors = e.errors()
    if errors and errors[0].get("type") == "json_invalid":
        return error_body(f"request body is not valid JSON: {errors[0].get('ctx', {}).get('error', '')}")
    messages, params = [], []
    for err in errors[:4]:
        field = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "model_attributes_type" and not field:
            messages.append("request body must be a JSON object (send Content-Type: application/json)")
        else:
            messages.append(f"{field or 'request body'}: {err.get('msg')}")
        params.append(field or None)
    return error_body("; ".join(messages) or "invalid request", param=params[0] if params else None)


def serve(llm, served_model_name: str, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, log_level: str = "info") -> None:
    """Run the server until SIGINT/SIGTERM (the `nanovllm serve` command); then stop the engine
    loop and the LLM (its workers included) before returning."""
    import signal
    import threading

    import uvicorn

    if threading.current_thread() is threading.main_thread():
        # uvicorn shuts down gracefully, then re-raises the signal: make SIGTERM's re-raise an
        # exception like SIGINT's, so the cleanup below runs instead of the process just dying.
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    engine = AsyncEngine(llm).start()
    app = build_app(engine, served_model_name, api_key)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    except KeyboardInterrupt:
        logger.info("stopping on signal")
    finally:
        engine.shutdown(timeout=10)
        llm.exit()


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt
