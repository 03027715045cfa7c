"""Tokenizing on the engine thread for the server: the prompts of a generation request (so their
lengths are checked before anything is queued) and vLLM's /tokenize and /detokenize routes.

NOTE: the tokenizer is used on the engine thread only (AsyncEngine.call), like the rest of the LLM.
"""
from fastapi import FastAPI

from nanovllm.entrypoints.async_engine import AsyncEngine, EngineStoppedError
from nanovllm.entrypoints.protocol import ApiError, DetokenizeRequest, TokenizeRequest, error_responses


async def on_engine(engine: AsyncEngine, fn):
    """fn(llm) on the engine thread; its ValueError/TypeError is a 400, a stopped engine a 503."""
    try:
        return await engine.call(fn)
    except (ValueError, TypeError) as e:
        raise ApiError(400, str(e)) from e
    except EngineStoppedError as e:
        raise ApiError(503, str(e), "server_error") from e


async def prompt_token_ids(engine: AsyncEngine, prompts: list) -> list[list[int]]:
    """Each prompt (text or token ids) as token ids, as LLM.generate would see it."""
    return await on_engine(engine, lambda llm: [llm.tokenize(p) for p in prompts])


async def conversation_token_ids(engine: AsyncEngine, conversation: list[dict]) -> list[int]:
    """A chat conversation through the model's chat template, as LLM.chat would see it."""
    def apply(llm) -> list[int]:
        from jinja2 import TemplateError
        try:
            return llm.apply_chat_template(conversation)
        except TemplateError as e:  # e.g. the template's own raise_exception("roles must alternate")
            raise ValueError(f"chat template failed on these messages: {e}") from e
    return await on_engine(engine, apply)


def _templated(llm, conversation: list[dict], add_generation_prompt: bool, add_special_tokens: bool) -> list[int]:
    from jinja2 import TemplateError

    tokenizer = _tokenizer_of(llm)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; send a prompt instead of messages")
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
    except TemplateError as e:  # e.g. the template's own raise_exception("roles must alternate")
        raise ValueError(f"chat template failed on these messages: {e}") from e
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _tokenizer_of(llm):
    if llm.tokenizer is None:
        raise ValueError("this model folder has no tokenizer: only token ids are understood")
    return llm.tokenizer


def _tokenize(llm, body: TokenizeRequest) -> dict:
    tokenizer = _tokenizer_of(llm)
    if body.messages is not None:
        conversation = [m.to_template_dict() for m in body.messages]
        ids = _templated(llm, conversation, body.add_generation_prompt, bool(body.add_special_tokens))
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = list(tokenizer.encode(body.prompt, add_special_tokens=add_special))
    out = {"count": len(ids), "max_model_len": llm.config.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


def _detokenize(llm, body: DetokenizeRequest) -> dict:
    tokenizer = _tokenizer_of(llm)
    bad = [t for t in body.tokens if not 0 <= t < llm.vocab_size]
    if bad:
        raise ValueError(f"tokens {bad[:4]} are outside the vocabulary [0, {llm.vocab_size})")
    return {"prompt": tokenizer.decode(body.tokens)}


def add_tokenize_routes(app: FastAPI, engine: AsyncEngine, check_model) -> None:
    """POST /tokenize and /detokenize with vLLM's bodies; `model` is optional, checked when given."""

    @app.post("/tokenize", responses=error_responses(400, 401, 404, 413, 503))
    async def tokenize(body: TokenizeRequest) -> dict:
        if body.model is not None:
            check_model(body.model)
        try:
            body.check_supported()
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt") from e
        return await on_engine(engine, lambda llm: _tokenize(llm, body))

    @app.post("/detokenize", responses=error_responses(400, 401, 404, 413, 503))
    async def detokenize(body: DetokenizeRequest) -> dict:
        if body.model is not None:
            check_model(body.model)
        return await on_engine(engine, lambda llm: _detokenize(llm, body))
