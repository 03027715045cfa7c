"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncEngine. Started by `nanovllm serve`
(nanovllm/cli.py) or by tests through build_app() + uvicorn.

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream`), OpenAI's Responses
API (/v1/responses, openai_responses.py), Anthropic's Messages API (/v1/messages,
anthropic_messages.py), /v1/embeddings (embeddings.py), GET /v1/models, GET /health, vLLM's POST
/tokenize, /detokenize, GET /tokenizer_info, /version, /metrics (Prometheus), and SGLang's GET
/model_info, /server_info for sglang-router (sglang_compat.py). Errors use OpenAI's body {"error":
{"message", "type", "param", "code"}} (Anthropic's under /v1/messages). Every request's work is
bounded before it is queued (limits.py).
"""
import hmac
import logging
import sys
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm.entrypoints.anthropic_errors import error_response as anthropic_error, is_messages_path
from nanovllm.entrypoints.anthropic_messages import add_messages_routes
from nanovllm.entrypoints.async_engine import AsyncEngine, EngineStepError, EngineStoppedError
from nanovllm.entrypoints.embeddings import add_embedding_routes
from nanovllm.entrypoints.lora_routes import ServedModels, add_lora_routes, checked_adapter
from nanovllm.entrypoints.limits import BodySizeLimit, ServerLimits, check_context_length, check_request
from nanovllm.entrypoints.chat_turn import ChatService, submit
from nanovllm.entrypoints.metrics import ServerMetrics
from nanovllm.entrypoints.openai_responses import add_responses_routes
from nanovllm.entrypoints.protocol import (ApiError, ChatCompletionRequest, CompletionRequest, as_bad_request,
                                           error_body, error_responses, generation_responses)
from nanovllm.entrypoints.serving import Generation, completion_response, chat_response, sse_chunks
from nanovllm.entrypoints.responses import ChatCompletionResponse, CompletionResponse, ModelList, VersionResponse
from nanovllm.entrypoints.sglang_compat import add_sglang_routes
from nanovllm.entrypoints.tokenization import add_tokenize_routes, echo_texts, prompt_token_ids
from nanovllm.entrypoints.tool_calls import ChatSettings, ToolReply, tools_note
from nanovllm.entrypoints.validation_errors import request_fields, validation_body
from nanovllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)

class ApiKeyMiddleware:
    """Plain ASGI middleware (streams pass through untouched): every path but /health needs
    `Authorization: Bearer <api_key>` (or Anthropic's `x-api-key: <api_key>`)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_x = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            headers = dict(scope["headers"])
            given, given_x = headers.get(b"authorization", b""), headers.get(b"x-api-key", b"")
            if not (hmac.compare_digest(given, self.expected) or hmac.compare_digest(given_x, self.expected_x)):
                message = "missing or incorrect API key"
                response = (anthropic_error(401, message) if is_messages_path(scope["path"]) else JSONResponse(
                    error_body(message, "authentication_error", code="invalid_api_key"), status_code=401))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
              limits: ServerLimits | None = None, chat: ChatSettings | None = None,
              model_aliases: tuple[str, ...] = (), lora_modules: tuple[LoRARequest, ...] = ()) -> FastAPI:
    """The FastAPI app serving one model under `served_model_name` (requests may also name it by
    one of model_aliases, or leave `model` out), and each of lora_modules under its own name
    (lora_routes.py; an engine with enable_lora). The engine must be started."""
    limits = limits or ServerLimits()
    chat = chat or ChatSettings()
    app = FastAPI(title="nano-vLLM OpenAI-compatible server")
    app.state.engine, app.state.limits = engine, limits
    app.state.metrics = metrics = ServerMetrics(served_model_name)
    created = int(time.time())
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes)
    if api_key:  # added last, so it runs first: no body is read for an unauthenticated client
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    _add_error_handlers(app)
    _document_errors_only_as_sent(app)

    served = ServedModels(served_model_name, model_aliases)
    for request in lora_modules:
        served.add(request)
    check_model = served.resolve  # a request's `model`: the base model (None) or an adapter; 404 otherwise

    @app.get("/health", responses=error_responses(503))
    async def health() -> JSONResponse:
        if not engine.is_running:
            return JSONResponse(error_body("engine loop stopped", "server_error"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models", responses={**error_responses(401), 200: {"model": ModelList}}, response_model=None)
    async def models() -> dict:
        return {"object": "list", "data": served.cards(created, engine.llm.config.max_model_len)}

    service = ChatService(engine, served_model_name, limits, metrics, chat, check_model)
    _add_generation_routes(app, service)
    add_tokenize_routes(app, engine, check_model, chat.trust_request_chat_template)
    add_embedding_routes(app, engine, served_model_name, limits, check_model)
    add_messages_routes(app, service)
    add_responses_routes(app, service)
    _add_info_routes(app, engine, metrics)
    add_sglang_routes(app, engine, served_model_name, _version())  # what sglang-router probes
    add_lora_routes(app, engine, served)
    return app


def _add_generation_routes(app: FastAPI, service: ChatService) -> None:
    """POST /v1/completions and /v1/chat/completions: checked, tokenized, checked again, then queued."""
    engine, limits = service.engine, service.limits
    config = engine.llm.config  # its sampling_defaults for fields a request leaves unset, its max_tokens_ceiling

    @app.post("/v1/completions", responses=generation_responses(CompletionResponse))
    async def completions(body: CompletionRequest, request: Request):
        arrival = time.perf_counter()
        lora = service.check_model(body.model)
        with as_bad_request():
            body.check_supported()
            prompts = body.prompts()
            check_request(body, len(prompts), limits)
            params = body.sampling_params(config.sampling_defaults, config.max_tokens_ceiling)
        prompt_ids = await prompt_token_ids(engine, prompts)
        check_context_length([len(ids) for ids in prompt_ids],
                             body.checked_max_tokens(config.sampling_defaults, config.max_tokens_ceiling), config.max_model_len)
        echoed = await echo_texts(engine, prompts, prompt_ids) if body.echo else None
        await checked_adapter(engine, lora)
        gen = service.generation("cmpl", params.n, params.logprobs, arrival, lora_request=lora,
                                 num_prompt_logprobs=params.prompt_logprobs, echo_texts=echoed,
                                 tokens_as_ids=bool(body.return_tokens_as_token_ids))
        return await _respond(gen, request, body, prompt_ids, params, "completion")

    @app.post("/v1/chat/completions", responses=generation_responses(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        arrival = time.perf_counter()
        asked = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        chat = await service.prepare(body, asked)
        conversation, tool_choice = chat.conversation, chat.tool_choice
        echoes = body.echo and conversation[-1].get("role") == "assistant"
        gen = service.generation("chatcmpl", chat.params.n, chat.params.logprobs, arrival, lora_request=chat.lora_request,
                                 echo_prefix=(conversation[-1].get("content") or "") if echoes else "",
                                 tokens_as_ids=bool(body.return_tokens_as_token_ids),
                                 new_tool_reply=((lambda: ToolReply(tool_choice, service.chat))
                                                 if tool_choice != "none" else None),
                                 reasoning=service.chat.reasoning)
        return await _respond(gen, request, body, [chat.prompt_ids], chat.params, "chat")


def _add_info_routes(app: FastAPI, engine: AsyncEngine, metrics: ServerMetrics) -> None:
    """GET /version and GET /metrics (Prometheus text format)."""

    @app.get("/version", responses={**error_responses(401), 200: {"model": VersionResponse}}, response_model=None)
    async def version() -> dict:
        return {"version": _version()}

    @app.get("/metrics", response_class=PlainTextResponse, responses=error_responses(401))
    async def prometheus_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST
        try:
            await metrics.refresh_gauges(engine)
        except EngineStoppedError:
            pass  # the gauges keep their last values; /health says the engine stopped
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("nano-vllm")
    except PackageNotFoundError:  # run from a source checkout that was never installed
        return "0.0.0+unknown"


def _document_errors_only_as_sent(app: FastAPI) -> None:
    """/openapi.json without FastAPI's default 422: validation errors leave as 400 (documented per route)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI's error body, or as Anthropic's under /v1/messages."""

    def answer(request: Request, body: dict, status: int, headers=None) -> JSONResponse:
        if is_messages_path(request.url.path):
            return anthropic_error(status, body["error"]["message"], headers)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError) -> JSONResponse:
        return answer(request, e.body, e.status)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return answer(request, validation_body(e, request_fields(request)), 400)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        # e.headers: a 405 carries Allow (the methods the path takes), as RFC 9110 requires.
        return answer(request, error_body(str(e.detail), type_), e.status_code, e.headers)

    @app.exception_handler(Exception)
    async def on_unexpected_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return answer(request, error_body(f"internal error: {type(e).__name__}", "server_error"), 500)


async def _respond(gen: Generation, request: Request, body, prompts: list, params, kind: str):
    await submit(gen, prompts, params)
    if body.stream:
        # StreamingResponse cancels the stream when the client hangs up, which aborts the requests;
        # the background task catches a hang-up before the stream even started.
        chunks = sse_chunks(gen, kind, body.include_usage, body.continuous_usage)
        return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(gen.abort_unfinished))
    try:
        if not await gen.run_unless_disconnected(request):
            return JSONResponse(error_body("client disconnected", "invalid_request_error"), status_code=499)
    except EngineStepError as e:
        raise ApiError(500, str(e), "server_error") from e
    return completion_response(gen) if kind == "completion" else chat_response(gen)


def serve(llm, served_model_name: str, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, log_level: str = "info", limits: ServerLimits | None = None,
          shutdown_timeout: float = 2.0, chat: ChatSettings | None = None,
          model_aliases: tuple[str, ...] = (), lora_modules: tuple[LoRARequest, ...] = ()) -> None:
    """Run the server until SIGINT/SIGTERM (the `nanovllm serve` command); then stop the engine
    loop and the LLM (its workers included) before returning.

    NOTE: shutdown is bounded: open responses get shutdown_timeout seconds to finish, then they
    are cancelled (which aborts their requests); the engine thread gets as long again to end its
    step. A step still running after that is abandoned (the thread is a daemon)."""
    import signal
    import threading

    import uvicorn

    if threading.current_thread() is threading.main_thread():
        # uvicorn shuts down gracefully, then re-raises the signal: make SIGTERM's re-raise an
        # exception like SIGINT's, so the cleanup below runs instead of the process just dying.
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    note = tools_note(llm.tokenizer, chat or ChatSettings())
    if note:
        logger.info(note)
    engine = AsyncEngine(llm).start()
    app = build_app(engine, served_model_name, api_key, limits, chat, model_aliases, lora_modules)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # The engine loop stops first, so every open response ends now, within the graceful
            # window: a stream with a last error event and [DONE], others with an error body;
            # none is left for uvicorn to cancel (a CancelledError traceback, a cut connection).
            engine.shutdown(timeout=0, reason="the server is shutting down")
            super().handle_exit(sig, frame)
    server = Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                   timeout_graceful_shutdown=shutdown_timeout))

    def exit_when_the_engine_dies() -> None:
        # /health is 503 and every request an error from the moment the engine died; the process
        # then ends with status 1, as vLLM's does, so a supervisor restarts it.
        engine._thread.join()
        if engine.died is not None:
            logger.error("exiting: the engine died (%s)", engine.died)
            server.should_exit = True
    threading.Thread(target=exit_when_the_engine_dies, name="nanovllm-engine-watch", daemon=True).start()
    try:
        server.run()
        if not server.started:  # it could not listen (uvicorn logged why): uvicorn.run's exit status
            sys.exit(3)
        if engine.died is not None:
            sys.exit(1)
    except KeyboardInterrupt:
        logger.info("stopping on signal")
    finally:
        engine.shutdown(timeout=shutdown_timeout)
        if engine._thread.is_alive():  # still inside a step
            logger.warning("the engine step did not end within %.1f s; exiting without it", shutdown_timeout)
        llm.exit()


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt
