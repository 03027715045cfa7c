"""What sglang-router needs of a worker: SGLang's probe routes (/model_info, /server_info and their
older /get_* names) and the SGLang request fields the router adds to every request it forwards.
openai_server.build_app adds the routes; protocol.py's request models inherit the fields.

Measured with sglang-router 0.3.2: it fills in these fields itself (a client cannot leave them
out), so a strict server must know them. Each is honoured, or accepted at its neutral value and
a 400 naming it otherwise; any other unknown field stays a 400.
"""
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:  # protocol.py imports the fields; the server stack stays out of that import
    from fastapi import FastAPI

    from nanovllm.entrypoints.async_engine import AsyncEngine


class SGLangSamplingFields(BaseModel):
    """Sent on /v1/completions and /v1/chat/completions alike."""

    model_config = ConfigDict(extra="forbid")

    # SGLang's "keep the stop string in the text": vLLM's include_stop_str_in_output (which the
    # router does not forward, so this is the only way to ask for it through the router).
    no_stop_trim: bool = False
    return_hidden_states: bool = False

    def check_sglang_fields(self) -> None:
        if self.return_hidden_states:
            raise ValueError("return_hidden_states is not supported (only false)")
        include = getattr(self, "include_stop_str_in_output", None)
        if self.no_stop_trim and include is False:
            raise ValueError("no_stop_trim=true contradicts include_stop_str_in_output=false")

    def sglang_sampling_kwargs(self) -> dict:
        """SamplingParams options these fields ask for."""
        return {"include_stop_str_in_output": True} if self.no_stop_trim else {}


class SGLangChatFields(SGLangSamplingFields):
    """Sent on /v1/chat/completions only (the router's continue_final_message is vLLM's field too,
    honoured by protocol.ChatTemplateOptions)."""

    # SGLang splits the reasoning text out only when launched with a reasoning parser; this server
    # has none, so, like SGLang without one, it leaves the text whole for either value.
    separate_reasoning: bool = True
    stream_reasoning: bool = True


def model_info(engine: "AsyncEngine", served_model_name: str) -> dict:
    """SGLang's /model_info body."""
    llm = engine.llm
    return {
        "model_path": llm.config.model,
        # A router on this host loads the tokenizer from here; elsewhere it only logs a warning.
        "tokenizer_path": llm.config.model if llm.tokenizer is not None else None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "served_model_name": served_model_name,
    }


def server_info(engine: "AsyncEngine", served_model_name: str, version: str) -> dict:
    """SGLang's /server_info body: its names for the settings this server has (one replica: dp_size 1)."""
    config = engine.llm.config
    return {
        **model_info(engine, served_model_name),
        "context_length": config.max_model_len,
        "tp_size": config.tensor_parallel_size,
        "dp_size": 1,
        "max_running_requests": config.max_num_seqs,
        "chunked_prefill_size": config.max_num_batched_tokens,
        "page_size": config.kvcache_block_size,
        "max_total_num_tokens": engine.llm.llm_engine.num_kvcache_blocks * config.kvcache_block_size,
        "disable_radix_cache": not config.enable_prefix_caching,
        "device": config.device,
        "internal_states": [],
        "version": version,
    }


def add_sglang_routes(app: "FastAPI", engine: "AsyncEngine", served_model_name: str, version: str) -> None:
    """GET /model_info, /server_info and the /get_model_info, /get_server_info that older routers ask."""

    async def get_model_info() -> dict:
        return model_info(engine, served_model_name)

    async def get_server_info() -> dict:
        return server_info(engine, served_model_name, version)

    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, get_model_info, methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, get_server_info, methods=["GET"])
