"""AsyncEngine: one background thread keeps stepping an LLM while requests arrive and leave.

The OpenAI server (entrypoints/openai_server.py) submits requests from its asyncio event loop and
reads each request's deltas from an asyncio.Queue. NOTE: only the engine thread touches the engine
state (scheduler, model, sequences), so nothing in the engine needs a lock. A request's preparation
(tokenizing, chat templates, compiling its grammar, detokenizing echoes) runs on a pool of
preparation threads instead (prepare()): it reads the tokenizer and the grammar cache only, and a
slow one delays its own request, not the engine's steps nor the other requests' preparation.
"""
import asyncio
import logging
import queue
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from nanovllm.engine.sequence import Sequence
from nanovllm.outputs.streaming import StreamDelta
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

HEALTH_CHECK_S = 1.0  # how often an idle engine thread asks whether the engine can still run
PREPARE_THREADS = 4  # requests prepared at once (tokenizing, templates, grammars); more wait their turn
# A failed step fails its own requests and the engine goes on; this many failures in a row, with no
# step that worked between them, mean the model runner itself is broken: the engine is dead.
MAX_FAILED_STEPS_IN_A_ROW = 3


class EngineStepError(RuntimeError):
    """The engine step that carried this request raised (or the loop stopped); it was aborted."""


class EngineStoppedError(RuntimeError):
    """The engine loop is not running: it accepts no request."""


@dataclass
class _Request:
    request_id: str
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    seqs: list[Sequence] = field(default_factory=list)


class AsyncEngine:
    """Continuous batching across callers: submit() returns at once; the engine thread adds the
    request before its next step, so no request waits for another to finish.

    Each delta (StreamDelta) goes to the request's queue; a failed step puts an EngineStepError.
    """

    def __init__(self, llm):
        self.llm = llm
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = False
        self._stop_reason = "the engine loop stopped"
        self._closed = False  # set by the engine thread as it exits; _post refuses from then on
        self._post_lock = threading.Lock()
        self._requests: dict[str, _Request] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="nanovllm-engine", daemon=True)
        # NOTE: several threads, so one slow preparation (a multi-MB prompt) holds up no other
        # request's. They share the tokenizer: its encode/decode calls only read it (the server never
        # changes its truncation or padding), and the grammar cache takes a lock.
        self._preparer = ThreadPoolExecutor(max_workers=PREPARE_THREADS, thread_name_prefix="nanovllm-prepare")
        _settle_tokenizer(llm.tokenizer)
        self.num_steps = 0
        self.num_failed_steps = 0
        self._failed_in_a_row = 0
        self.num_aborted = 0  # requests aborted before they finished (client gone, failed step)
        self.died: str | None = None  # why the engine can run no further step, once it cannot

    # ---- event-loop side --------------------------------------------------------------------
    def start(self) -> "AsyncEngine":
        self._thread.start()
        return self

    def shutdown(self, timeout: float | None = None, reason: str | None = None) -> None:
        """Stop the engine loop, waiting up to timeout for it (0: return at once). Open requests
        end with an EngineStepError saying reason (default: the engine loop stopped)."""
        if reason is not None and not self._stopping:
            self._stop_reason = reason
        self._stopping = True
        self._wakeup.set()
        self._preparer.shutdown(wait=False, cancel_futures=True)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @staticmethod
    def new_request_id(prefix: str = "req") -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    async def submit(self, request_id: str, prompt: str | list[int] | list[dict],
                     sampling_params: SamplingParams, out: asyncio.Queue, lora_request=None) -> list[int]:
        """Queue one request (a chat conversation if prompt is a list of messages); returns its
        prompt token ids once the engine thread accepted it, or raises the validation error."""
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        self._post(("add", _Request(request_id, out, loop), prompt, sampling_params, accepted, lora_request))
        return await accepted

    def abort(self, request_id: str) -> None:
        """Abort a request (a no-op once it finished); its KV blocks are freed before the next step."""
        self._post(("abort", request_id))

    async def prepare(self, fn):
        """fn(llm) on a preparation thread (tokenizer and grammar work: nothing that changes the
        engine's state); its result, or its exception."""
        if self._stopping or self._closed:
            raise EngineStoppedError("the engine loop is not running")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._preparer, fn, self.llm)
        except RuntimeError as e:
            if self._stopping or self._closed:  # the executor was shut down under us
                raise EngineStoppedError("the engine loop is not running") from e
            raise

    def call(self, fn) -> "asyncio.Future":
        """Run fn(llm) on the engine thread between steps; await the returned future for its result."""
        fut = asyncio.get_running_loop().create_future()
        self._post(("call", fn, fut))
        return fut

    def _post(self, command: tuple) -> None:
        with self._post_lock:
            if self._closed or self._stopping:
                if command[0] == "abort":
                    return  # the loop already aborted everything on its way out
                raise EngineStoppedError("the engine loop is not running")
            self._inbox.put(command)
        self._wakeup.set()

    # ---- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            try:
                self._run_once()
            except Exception as e:  # a bug outside the step: the engine state is unknown, so it is dead
                logger.exception("engine loop error")
                self._die(f"engine loop error: {type(e).__name__}: {e}")
        with self._post_lock:
            self._closed = True
        self._drain_inbox()  # adds posted before closing are refused below
        for request_id in list(self._requests):
            self._fail(request_id, self._stop_reason)

    def _run_once(self) -> None:
        self._drain_inbox()
        if self.llm.llm_engine.is_finished():
            # NOTE: idle, it still looks every HEALTH_CHECK_S: a worker that dies between requests
            # turns /health to 503 without waiting for the next request to find out.
            if not self._wakeup.wait(HEALTH_CHECK_S):
                self._check_alive()
            self._wakeup.clear()
            return
        try:
            step = self.llm.llm_engine.step()
        except Exception as e:  # fail this step's requests; keep serving everyone else, if it can
            self.num_failed_steps += 1
            self._failed_in_a_row += 1
            logger.exception("engine step failed")
            self._fail_step(e)
            self._check_alive()
            if self._failed_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW and not self._stopping:
                self._die(f"{self._failed_in_a_row} engine steps in a row failed, the last with "
                          f"{type(e).__name__}: {e}")
            return
        self.num_steps += 1
        self._failed_in_a_row = 0
        self._deliver(step.deltas)
        if step.num_tokens == 0:  # nothing could be scheduled yet: don't spin, wait for news
            self._wakeup.wait(0.01)
            self._wakeup.clear()

    def _check_alive(self) -> None:
        reason = self.llm.llm_engine.broken_reason()
        if reason is not None:
            self._die(reason)

    def _die(self, reason: str) -> None:
        """The engine can run no further step: stop the loop; every open request ends with reason,
        every new one is refused (the server then answers 503 and exits, see openai_server.serve)."""
        logger.error("the engine died: %s", reason)
        self.died = reason
        if not self._stopping:
            self._stop_reason = f"the engine died: {reason}"
        self._stopping = True

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                self._abort(command[1])
            elif kind == "call":
                _, fn, fut = command
                try:
                    _resolve(fut, result=fn(self.llm))
                except Exception as e:
                    _resolve(fut, error=e)

    def _add(self, req: _Request, prompt, sampling_params: SamplingParams, accepted, lora_request=None) -> None:
        try:
            if self._closed:
                raise EngineStoppedError("the engine loop is not running")
            if req.request_id in self._requests:
                raise ValueError(f"request id {req.request_id!r} is already in use")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
                prompt = self.llm.apply_chat_template(prompt)
            req.seqs = self.llm.llm_engine.add_request_group(prompt, sampling_params, req.request_id, stream=True,
                                                             lora_request=lora_request)
        except Exception as e:  # validation errors go back to the caller, not to the loop
            _resolve(accepted, error=e)
            return
        self._requests[req.request_id] = req
        _resolve(accepted, result=list(req.seqs[0].prompt_token_ids))

    def _abort(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        unfinished = [seq for seq in req.seqs if not seq.is_finished]
        for seq in unfinished:
            self.llm.llm_engine.abort_request(seq)
        self.num_aborted += bool(unfinished)

    def _fail_step(self, error: Exception) -> None:
        failed = getattr(error, "step_request_ids", None)  # (LLMEngine.step)
        if failed is None:  # the step failed before it picked its sequences: the engine state is unknown
            failed = set(self._requests)
        for request_id in failed & set(self._requests):
            self._fail(request_id, f"engine step failed: {type(error).__name__}: {error}")

    def _fail(self, request_id: str, message: str) -> None:
        """Abort a request and tell its caller why."""
        req = self._requests.get(request_id)
        self._abort(request_id)
        if req is not None:
            _call_soon(req.loop, req.out.put_nowait, EngineStepError(message))

    def _deliver(self, deltas: list[StreamDelta]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        done = set()
        for delta in deltas:
            req = self._requests.get(delta.request_id)
            if req is None:
                continue
            by_loop.setdefault(req.loop, []).append((req.out, delta))
            # NOTE: a sequence's last delta comes in the step it finishes, so once all are finished
            # the request has had every delta.
            if delta.is_finished and all(s.is_finished for s in req.seqs):
                done.add(delta.request_id)
        for request_id in done:
            del self._requests[request_id]
        for loop, items in by_loop.items():
            if not _call_soon(loop, _put_all, items):  # nobody listens any more
                for request_id in {delta.request_id for _, delta in items}:
                    self._abort(request_id)


def _settle_tokenizer(tokenizer) -> None:
    """A fast tokenizer whose file sets truncation or padding is reconfigured by its first encode
    (transformers switches both off for our calls); done here once, before any thread shares it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """Schedule fn(*args) on an event loop from the engine thread; False if that loop is closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:
        return False


def _put_all(items: list[tuple[asyncio.Queue, StreamDelta]]) -> None:
    for out, delta in items:
        out.put_nowait(delta)


def _resolve(fut: asyncio.Future, result=None, error: Exception | None = None) -> None:
    """Settle an event-loop future from the engine thread (unless its awaiter gave up)."""
    def settle() -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    _call_soon(fut.get_loop(), settle)
