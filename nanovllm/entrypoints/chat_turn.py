"""One chat turn, shared by /v1/chat/completions, /v1/responses and /v1/messages.

ChatService.prepare checks a ChatCompletionRequest (the agent APIs translate their bodies into one),
applies its tool choice, renders its prompt through the chat template and checks its length, all
before anything is queued; with --reasoning-parser, a constraint (structured outputs, a forced tool
call) applies to the answer after the thinking. ChatService.start_turn queues it as an
AssistantTurn: the reply read as the agent APIs see it, a sequence of blocks (thinking, text, tool
calls), streamed as open / delta / close events or awaited whole.
"""
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from nanovllm.entrypoints.lora_routes import checked_adapter
from nanovllm.entrypoints.async_engine import AsyncEngine, EngineStoppedError
from nanovllm.entrypoints.limits import ServerLimits, check_context_length, check_request
from nanovllm.entrypoints.metrics import MeteredGeneration, ServerMetrics
from nanovllm.entrypoints.protocol import ApiError, ChatCompletionRequest, as_bad_request
from nanovllm.entrypoints.reasoning import END as THINKING_END, ReasoningParser
from nanovllm.entrypoints.serving import Generation, unless_disconnected
from nanovllm.entrypoints.tokenization import chat_prompt_ids, prepared
from nanovllm.entrypoints.tool_calls import (ChatSettings, ToolReply, ToolsWarning, template_tools, tool_choice_of,
                                             with_forced_call)
from nanovllm.sampling_params import SamplingParams


@dataclass
class PreparedChat:
    params: SamplingParams
    tool_choice: str | None  # "none", "auto", "required" or a tool's name
    conversation: list[dict]
    prompt_ids: list[int]
    lora_request: object = None  # the adapter the request's `model` names (None: the base model)


@dataclass
class Block:
    """One part of a reply: "reasoning" (the thinking), "text", or "call" (a tool call: its name,
    call id and arguments as JSON text in `text`). id: the part's own id (Responses' item id)."""
    kind: str
    id: str
    text: str = ""
    name: str | None = None
    call_id: str | None = None


_ID_PREFIX = {"reasoning": "rs", "text": "msg", "call": "fc"}


def _new_block(kind: str, **fields) -> Block:
    return Block(kind, f"{_ID_PREFIX[kind]}_{uuid.uuid4().hex[:24]}", **fields)


@dataclass
class ChatService:
    """What the chat routes share: the engine, the server's settings and metrics."""
    engine: AsyncEngine
    served_model_name: str
    limits: ServerLimits
    metrics: ServerMetrics
    chat: ChatSettings
    check_model: Callable[[str | None], object]  # a request's `model` -> its LoRARequest or None; 404 if unknown
    tools_warning: ToolsWarning = field(init=False)

    def __post_init__(self) -> None:
        self.tools_warning = ToolsWarning(self.engine.llm.tokenizer, self.chat)

    def generation(self, prefix: str, n: int, logprobs: int | None, arrival: float, lora_request=None,
                   **settings) -> Generation:
        model = self.served_model_name if lora_request is None else lora_request.lora_name
        return MeteredGeneration(self.engine, self.engine.new_request_id(prefix), model, n, logprobs,
                                 metrics=self.metrics, arrival=arrival, lora_request=lora_request, **settings)

    async def prepare(self, body: ChatCompletionRequest, max_tokens_param: str = "max_tokens") -> PreparedChat:
        """body checked, its prompt rendered and its length checked (ApiError 400 on any fault)."""
        lora = self.check_model(body.model)
        config = self.engine.llm.config
        with as_bad_request():
            body.check_supported()
            check_request(body, 1, self.limits)
            params = body.sampling_params(config.sampling_defaults, config.max_tokens_ceiling)
            tool_choice = tool_choice_of(body, self.chat)
            params = with_forced_call(params, body, tool_choice, self.chat)
            conversation = body.conversation()
        if body.tools:
            self.tools_warning.request_brings_tools()
        prompt_ids = await chat_prompt_ids(self.engine, conversation, body, template_tools(body),
                                           body.add_special_tokens, self.chat.trust_request_chat_template)
        check_context_length([len(prompt_ids)], body.checked_max_tokens(config.sampling_defaults,
                             config.max_tokens_ceiling), config.max_model_len, "messages", max_tokens_param)
        params = await self._constrain_after_thinking(params, prompt_ids)
        await checked_adapter(self.engine, lora)
        return PreparedChat(params, tool_choice, conversation, prompt_ids, lora)

    async def _constrain_after_thinking(self, params: SamplingParams, prompt_ids: list[int]) -> SamplingParams:
        """With a reasoning parser, a constraint starts after the reply's </think>, unless the prompt
        already closed the thinking (Qwen3's template with enable_thinking false writes an empty block)."""
        constraint = params.structured_outputs
        if self.chat.reasoning is None or constraint is None:
            return params

        def closed(llm) -> bool:
            return llm.tokenizer.decode(prompt_ids[-16:]).rstrip().endswith(THINKING_END)
        if await prepared(self.engine, closed):
            return params
        return replace(params, structured_outputs=replace(constraint, starts_after=THINKING_END))

    async def start_turn(self, body: ChatCompletionRequest, prefix: str,
                         max_tokens_param: str = "max_tokens") -> "AssistantTurn":
        """body prepared and queued (one reply); ApiError if refused."""
        arrival = time.perf_counter()
        chat = await self.prepare(body, max_tokens_param)
        gen = self.generation(prefix, 1, None, arrival, lora_request=chat.lora_request)
        await submit(gen, [chat.prompt_ids], chat.params)
        reply = ToolReply(chat.tool_choice, self.chat) if chat.tool_choice != "none" else None
        return AssistantTurn(gen, self.chat.reasoning, reply)


async def submit(gen: Generation, prompts: list, params: SamplingParams) -> None:
    """Queue gen's prompts, their grammar compiled first beside the engine's steps (then found cached)."""
    if params.structured_outputs is not None:
        await prepared(gen.engine, lambda llm: llm.llm_engine.grammars.compile(params.structured_outputs))
    try:
        await gen.submit(prompts, params)
    except (ValueError, TypeError) as e:
        raise ApiError(400, str(e)) from e
    except EngineStoppedError as e:
        raise ApiError(503, str(e), "server_error") from e


class AssistantTurn:
    """One queued reply read as blocks: the thinking (with a reasoning parser), text, and tool calls
    (with a tool choice), in the order the model wrote them. Text that is only blank before a call
    or at the end makes no block."""

    def __init__(self, gen: Generation, reasoning: ReasoningParser | None, tool_reply: ToolReply | None):
        self.gen, self.reasoning, self.tool_reply = gen, reasoning, tool_reply
        self.blocks: list[Block] = []
        self.finish_reason: str | None = None  # "stop", "length" or "tool_calls"
        self.stop_reason: int | str | None = None  # the stop string (or token id) that ended it
        self.num_output_tokens = 0

    @property
    def num_prompt_tokens(self) -> int:
        return self.gen.prompt_lens[0]

    @property
    def text(self) -> str:
        return "".join(b.text for b in self.blocks if b.kind == "text")

    async def events(self) -> AsyncIterator[tuple[str, Block, str]]:
        """("open", block, ""), ("delta", block, piece) and ("close", block, ""), one block open at a
        time; raises EngineStepError if a step failed. Leaving early aborts the request."""
        thinking = self.reasoning.stream() if self.reasoning is not None else None
        current: Block | None = None
        blank = ""  # blank text held until something visible follows it
        calls: dict[int, Block] = {}
        async for _, delta, _ in self.gen.deltas():
            text, pieces = delta.text or "", []
            if thinking is not None:
                reasoning, text = thinking.feed(text, delta.is_finished)
                if reasoning:
                    pieces.append(("reasoning", reasoning, None))
            if self.tool_reply is not None:
                text, call_deltas = self.tool_reply.feed(text, delta.is_finished)
                pieces += [("text", text, None)] + [("call", d["function"]["arguments"], d) for d in call_deltas]
            else:
                pieces.append(("text", text, None))
            for kind, piece, call in pieces:
                if kind == "call" and call["index"] not in calls:
                    block = calls[call["index"]] = _new_block("call", name=call["function"]["name"], call_id=call["id"])
                elif kind == "call":
                    block = calls[call["index"]]
                elif current is not None and current.kind == kind:
                    block = current
                elif kind == "text" and not (blank + piece).strip():
                    blank += piece
                    continue
                else:
                    block = _new_block(kind)
                    piece, blank = (blank + piece, "") if kind == "text" else (piece, blank)
                if block is not current:
                    if current is not None:
                        yield "close", current, ""
                    current = block
                    self.blocks.append(block)
                    yield "open", block, ""
                if piece:
                    block.text += piece
                    yield "delta", block, piece
            if delta.is_finished:
                self.finish_reason = (self.tool_reply.finish_reason(delta.finish_reason) if self.tool_reply
                                      else delta.finish_reason)
                self.stop_reason = delta.stop_reason
            self.num_output_tokens = delta.num_output_tokens
        if current is not None:
            yield "close", current, ""

    async def run(self, request=None) -> "AssistantTurn | None":
        """The whole reply; with the HTTP request, None if the client hung up first (the request
        then aborted)."""
        async def consume():
            async for _ in self.events():
                pass
        if request is None:
            await consume()
            return self
        return self if await unless_disconnected(consume(), request) else None

    def reasoning_tokens(self) -> int:
        """Output tokens spent thinking (Responses' usage.output_tokens_details), by the thinking's
        share of the reply's characters: the deltas carry text, not each token's part."""
        chars = sum(len(b.text) for b in self.blocks)
        thought = sum(len(b.text) for b in self.blocks if b.kind == "reasoning")
        return round(self.num_output_tokens * thought / chars) if chars else 0
