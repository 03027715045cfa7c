"""Tokenizing on the engine thread for the server: the prompts of a generation request (so their
lengths are checked before anything is queued) and vLLM's /tokenize and /detokenize routes.

NOTE: the tokenizer is used on the engine thread only (AsyncEngine.call), like the rest of the LLM.
"""
from fastapi import FastAPI

from nanovllm.entrypoints.async_engine import AsyncEngine, EngineStoppedError
from nanovllm.entrypoints.protocol import (ApiError, ChatTemplateOptions, DetokenizeRequest, TokenizeRequest,
                                           error_responses)
from nanovllm.entrypoints.responses import DetokenizeResponse, TokenizeResponse
from nanovllm.utils.chat_template import render_chat


async def prepared(engine: AsyncEngine, fn):
    """fn(llm) on one of the engine's preparation threads, beside its steps (tokenizer work only); its
    ValueError/TypeError is a 400, a stopped engine a 503."""
    try:
        return await engine.prepare(fn)
    except (ValueError, TypeError) as e:
        raise ApiError(400, str(e)) from e
    except EngineStoppedError as e:
        raise ApiError(503, str(e), "server_error") from e


async def prompt_token_ids(engine: AsyncEngine, prompts: list) -> list[list[int]]:
    """Each prompt (text or token ids) as token ids, as LLM.generate would see it."""
    return await prepared(engine, lambda llm: [llm.tokenize(p) for p in prompts])


async def chat_prompt_ids(engine: AsyncEngine, conversation: list[dict], options: ChatTemplateOptions,
                          tools: list[dict] | None, add_special_tokens: bool,
                          trust_request_chat_template: bool) -> list[int]:
    """A chat request's prompt: its messages (and tools) through the chat template with its options."""
    if options.chat_template is not None and not trust_request_chat_template:
        raise ApiError(400, "chat_template in a request needs `nanovllm serve --trust-request-chat-template`",
                       param="chat_template")
    return await prepared(engine, lambda llm: _templated(llm, conversation, options, tools, add_special_tokens))


def _templated(llm, conversation: list[dict], options: ChatTemplateOptions, tools: list[dict] | None,
               add_special_tokens: bool) -> list[int]:
    return render_chat(llm.tokenizer, conversation, tools=tools, documents=options.documents,
                       chat_template=options.chat_template, add_generation_prompt=options.adds_generation_prompt,
                       continue_final_message=options.continue_final_message, add_special_tokens=add_special_tokens,
                       template_kwargs=options.chat_template_kwargs)


def _tokenizer_of(llm):
    if llm.tokenizer is None:
        raise ValueError("this model folder has no tokenizer: only token ids are understood")
    return llm.tokenizer


def _tokenize(llm, body: TokenizeRequest) -> dict:
    tokenizer = _tokenizer_of(llm)
    if body.messages is not None:
        conversation = [m.to_template_dict() for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        ids = _templated(llm, conversation, body, tools, bool(body.add_special_tokens))
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = list(tokenizer.encode(body.prompt, add_special_tokens=add_special))
    out = {"count": len(ids), "max_model_len": llm.config.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


def _detokenize(llm, body: DetokenizeRequest) -> dict:
    tokenizer = _tokenizer_of(llm)
    bad = [t for t in body.tokens if not 0 <= t < llm.llm_engine.vocab_size]
    if bad:
        raise ValueError(f"tokens {bad[:4]} are outside the vocabulary [0, {llm.llm_engine.vocab_size})")
    return {"prompt": tokenizer.decode(body.tokens)}


async def echo_texts(engine: AsyncEngine, prompts: list, prompt_ids: list[list[int]]) -> list[str]:
    """Each prompt's text for a completion's echo: a text prompt as sent, token ids decoded."""
    def texts(llm) -> list[str]:
        return [p if isinstance(p, str) else _tokenizer_of(llm).decode(ids) for p, ids in zip(prompts, prompt_ids)]
    return await prepared(engine, texts)


def _json_safe(value) -> bool:
    return value is None or isinstance(value, (str, int, float, bool)) or (
        isinstance(value, (list, tuple)) and all(_json_safe(v) for v in value)) or (
        isinstance(value, dict) and all(isinstance(k, str) and _json_safe(v) for k, v in value.items()))


def _tokenizer_info(llm) -> dict:
    """vLLM's /tokenizer_info: the tokenizer's class and its tokenizer_config.json settings (the
    JSON-representable ones), with the chat template, special tokens and the engine's max length."""
    tokenizer = _tokenizer_of(llm)
    info = {k: v for k, v in getattr(tokenizer, "init_kwargs", {}).items() if _json_safe(v)}
    info.update({k: str(v) for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)})
    info.update(tokenizer_class=type(tokenizer).__name__, chat_template=getattr(tokenizer, "chat_template", None),
                model_max_length=llm.config.max_model_len,
                additional_special_tokens=[str(t) for t in tokenizer.all_special_tokens])
    return info


def add_tokenize_routes(app: FastAPI, engine: AsyncEngine, check_model,
                        trust_request_chat_template: bool = False) -> None:
    """POST /tokenize and /detokenize with vLLM's bodies; `model` is optional, checked when given;
    GET /tokenizer_info."""

    @app.get("/tokenizer_info", responses=error_responses(400, 401))
    async def tokenizer_info() -> dict:
        return await prepared(engine, _tokenizer_info)

    @app.post("/tokenize", responses={**error_responses(400, 401, 404, 413, 503), 200: {"model": TokenizeResponse}},
              response_model=None)
    async def tokenize(body: TokenizeRequest) -> dict:
        if body.model is not None:
            check_model(body.model)
        try:
            body.check_supported()
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt") from e
        if body.chat_template is not None and not trust_request_chat_template:
            raise ApiError(400, "chat_template in a request needs `nanovllm serve --trust-request-chat-template`",
                           param="chat_template")
        return await prepared(engine, lambda llm: _tokenize(llm, body))

    @app.post("/detokenize",
              responses={**error_responses(400, 401, 404, 413, 503), 200: {"model": DetokenizeResponse}},
              response_model=None)
    async def detokenize(body: DetokenizeRequest) -> dict:
        if body.model is not None:
            check_model(body.model)
        return await prepared(engine, lambda llm: _detokenize(llm, body))
