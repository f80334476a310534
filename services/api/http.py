"""HTTP front door on the router: OpenAI-compatible and SGLang-native endpoints, /health, /metrics.

Every completion response (non-streaming; the last chunk when streaming) carries `usage` and a
`hybridcache` object with the request's cache statistics (the CLI's `stats`). When the combine
worker's waiting queue is full the answer is 429 with a Retry-After header (a streaming request
too: its headers wait for its first token). A client that disconnects cancels its request.

What a client sends is bounded before it costs much: the body's size (Content-Length, then what is
read) by --max-request-bytes, the time to send the headers and the body by the HTTP timeouts; JSON
is parsed and text tokenized off the event loop. Every error is a JSON object
`{"error": {"message", "type", "code"}}`, with a 4xx status for what the client got wrong.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import logging
import math
import queue
import threading
import time
import uuid
import weakref

import orjson
from aiohttp import web
from hybridcache.services import security
from hybridcache.services.api.chat_template import ChatLimits, ChatTemplate, PrepareDeadline
from hybridcache.services.api.openai_compat import (
    NO_TEMPLATE,
    Fanout,
    chat_requests,
    chat_to_native,
    completion_requests,
    parse_tool_calls,
    prompt_list,
    sglang_requests,
    streamable_prefix,
)
from hybridcache.services.config import RuntimeConfig
from hybridcache.services.observability import metrics
from hybridcache.services.router.router import Overloaded, Router, ServiceUnavailable, StreamControl
from hybridcache.services.runtime.sampling import RequestError

log = logging.getLogger("hybridcache.http")
_END = object()


def _error(status: int, message: str, headers: dict | None = None) -> web.Response:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            405: "invalid_request_error", 408: "request_timeout", 413: "request_too_large",
            429: "rate_limit_exceeded", 503: "service_unavailable"}.get(status, "error")
    metrics.request_answered("http", status)
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status,
                             headers=headers)


def _overloaded(e: Overloaded) -> web.Response:
    return _error(429, str(e), {"Retry-After": str(max(1, math.ceil(e.retry_after_s)))})


@web.middleware
async def json_errors(request: web.Request, handler):
    """Every error answer as JSON: aiohttp's own (404 no such route, 405, 413) and, for a fault of
    this server, a 500 whose traceback goes to the log."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(e.status, e.reason if e.text is None or e.text.startswith(f"{e.status}:") else e.text)
    except Exception as e:  # noqa: BLE001 - answered, logged with its traceback
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, f"internal error: {type(e).__name__}")


def _parse_json(raw: bytes):
    # orjson: a body of 32 documents of 1,024 token ids parses in a fifth of json.loads' time.
    # It refuses what is not strict JSON (NaN, invalid UTF-8, lone surrogates, nesting past 1,024)
    # with a JSONDecodeError, answered 400 like any malformed body.
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        if str(e).startswith("depth limit exceeded"):
            raise _Reject(400, "malformed JSON: nested too deeply") from None
        raise _Reject(400, f"malformed JSON: {e}") from None


def _json_object(raw: bytes, max_values: int | None = None) -> dict:
    """The body's JSON object; with `max_values`, a body with more commas than that (more values
    than any request served here holds) is refused before it is parsed."""
    if max_values is not None and raw.count(b",") > max_values:
        raise _Reject(400, "the request holds more JSON values than any request this server serves could "
                           "(its text and token ids past the served length)")
    body = _parse_json(raw)

    if not isinstance(body, dict):
        raise _Reject(400, "the request body must be a JSON object")
    return body


async def start_server(app: web.Application, host: str, port: int, config: RuntimeConfig,
                       ssl_context=None) -> web.AppRunner:
    """Serve `app` on host:port (TLS with `ssl_context`); returns the AppRunner (cleanup() stops it)."""
    # handler_cancellation: a client that disconnects cancels its handler, and so its request.
    # aiohttp's keep-alive timer runs while a connection has no whole request head, from its opening
    # as between requests, and data that trickles in does not reset it: it is the header timeout.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                           keepalive_timeout=config.http_header_timeout_s, shutdown_timeout=config.drain_grace_s)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    return runner


class _Workers:
    """Daemon threads that run requests (parsing, then the router's blocking stream), reused: a
    request starts a thread of its own only when none is idle; one idle for IDLE_S ends."""

    IDLE_S = 60.0

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a job that no submit has claimed

    def submit(self, fn) -> None:
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        self._jobs.put(fn)
        if spawn:
            threading.Thread(target=self._run, name="http-request", daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                fn = self._jobs.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # not claimed by a submit since: this thread ends
                        self._idle -= 1
                        return
                continue  # claimed: its job is (about to be) in the queue
            try:
                fn()
            except BaseException:  # noqa: BLE001 - a job hands its errors to the event loop itself
                log.exception("request thread failed")
            with self._lock:
                self._idle += 1


class _Mailbox:
    """Calls from worker threads into one event loop, coalesced: the first call posted while none
    is pending wakes the loop (call_soon_threadsafe: a write to its self-pipe and a pass of its
    selector), and the calls posted before that wake-up runs go with it, in the order each thread
    posted them. Every running stream's worker thread posts its token once a scheduler step, all
    within a fraction of a millisecond, so a step's tokens cost the loop one wake-up, not one each."""

    _of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _of_lock = threading.Lock()

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Mailbox:
        with cls._of_lock:
            box = cls._of.get(loop)
            if box is None:
                box = cls._of[loop] = cls(loop)
            return box

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._calls: collections.deque = collections.deque()
        self._pending = False

    def post(self, fn, *args) -> None:
        with self._lock:
            self._calls.append((fn, args))
            if self._pending:
                return
            self._pending = True
        try:
            self._loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # the loop closed: nobody is left to take the call
            with self._lock:
                self._pending = False
                self._calls.clear()

    def _run(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, collections.deque()
            self._pending = False
        for fn, args in calls:
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - one call's failure does not drop the others
                log.exception("a call from a request thread failed")


class _Run:
    """One request's work in a worker thread: its parsing (`parsed`, a future of the event loop),
    then at once, in the same thread, the router's token stream of it, fed to the event loop
    through a queue. chunks() iterates that stream; close() (or leaving chunks() early: the
    client went away, a failed write, the handler cancelled) cancels the request.

    A request parsed is handed to the event loop once it went to a combine worker (the stream's
    `sent`), or with the stream's first item, whichever comes first: the handler's next steps
    (its response's set-up, up to waiting for the first chunk) then run while the combine
    worker works, not between the parse and the plan, both of them wanting the GIL."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._mailbox = _Mailbox.of(loop)
        self.parsed: asyncio.Future = loop.create_future()
        self._q: asyncio.Queue = asyncio.Queue()
        self.control = StreamControl()
        self.done = False

    def _call(self, fn, *args) -> None:
        if not self._loop.is_closed():
            self._mailbox.post(fn, *args)

    def _deliver(self, chunk) -> None:
        self._call(self._q.put_nowait, chunk)

    def _settle(self, result=None, error: BaseException | None = None) -> None:
        if not self.parsed.done():  # cancelled with its handler
            if error is not None:
                self.parsed.set_exception(error)
            else:
                self.parsed.set_result(result)

    def work(self, prepare, stream) -> None:
        """(in the worker thread) parsed = prepare(); then the chunks of stream(parsed, control,
        sent, direct), `sent` a callable that hands `parsed` to the event loop (at most once),
        `direct` one that takes a chunk to it from any thread (Router.stream's direct path: the
        chunks it does not yield)."""
        try:
            parsed = prepare()
        except Exception as e:  # noqa: BLE001 - raised in the event loop
            self._call(self._settle, None, e)
            return
        handed = False

        def hand() -> None:
            nonlocal handed
            if not handed:
                handed = True
                self._call(self._settle, parsed)

        if self.control.cancelled:  # the handler went away meanwhile
            return
        try:
            for chunk in stream(parsed, self.control, hand, self._deliver):
                hand()
                self._deliver(chunk)
        except Exception as e:  # handed to the event loop, raised there
            hand()
            self._call(self._q.put_nowait, e)
        hand()
        self._call(self._q.put_nowait, _END)

    async def chunks(self):
        try:
            while (item := await self._q.get()) is not _END:
                if isinstance(item, Exception):
                    raise item
                yield item
            self.done = True
        finally:
            self.close()

    def close(self) -> None:
        if not self.done:
            self.control.cancel()

    def interrupt(self, error: Exception) -> None:
        """(on the event loop) End the request with `error`: its handler answers with it (an error
        event when its stream has begun), its work on the combine worker is cancelled."""
        if not self.parsed.done():
            self.parsed.set_exception(error)
        self._q.put_nowait(error)
        self.close()


class Draining(ServiceUnavailable):
    """The router is shutting down and the drain grace is over (HTTP 503, an SSE error event, gRPC
    UNAVAILABLE)."""

    def __init__(self):
        super().__init__("the server is shutting down and this request did not finish within its drain grace; "
                         "retry elsewhere or later")




# A chat of more messages than this many per segment a request may have is refused before it renders
# (its user and assistant texts are segments, and the markup between them too: none could be served).
CHAT_MESSAGES_PER_SEGMENT = 8

# What a load balancer's probes read: open even with an API key (/metrics too with --metrics-open).
OPEN_PATHS = frozenset({"/health", "/livez"})


def api_key_check(api_keys: str | list[str], open_paths=OPEN_PATHS):
    """A middleware: 401 unless `Authorization: Bearer KEY` with KEY one of `api_keys` (each
    compared in constant time), but on `open_paths`; request["tenant"] names the key's client
    (security.tenant_of)."""
    keys = [api_keys] if isinstance(api_keys, str) else list(api_keys)
    expected = [f"Bearer {k}".encode() for k in keys]
    tenants = {e: security.tenant_of(k) for e, k in zip(expected, keys)}

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path not in open_paths:
            got = request.headers.get("Authorization", "").encode()
            if not security.matches(got, expected):
                metrics.UNAUTHENTICATED.labels(door="http").inc()
                return _error(401, "missing or wrong API key (Authorization: Bearer KEY)",
                              {"WWW-Authenticate": "Bearer"})
            request["tenant"] = tenants[got]
        return await handler(request)

    return check


class Api:
    def __init__(self, router: Router, served_model: str, config: RuntimeConfig | None = None,
                 api_key: str | list[str] | None = None, chat_template: ChatTemplate | None = None):
        self.router = router
        self.served_model = served_model
        self.config = config or router.runtime
        self.api_keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        # --cache-isolation per-key: every request's caches are keyed by its API key (tenant_salt)
        self.per_key = self.config.cache_isolation == "per-key"
        if self.per_key and not self.api_keys:
            raise ValueError("--cache-isolation per-key needs API keys")
        # the model's chat template (None: chats are concatenated texts, as the stats say)
        self.chat_template = chat_template
        self.chat_template_source = chat_template.source if chat_template else NO_TEMPLATE
        self._workers = _Workers()
        self._runs: set[_Run] = set()  # requests in flight (drain ends those left with an error)

    def app(self) -> web.Application:
        open_paths = OPEN_PATHS | ({"/metrics"} if self.config.metrics_open else set())
        middlewares = [json_errors] + ([api_key_check(self.api_keys, open_paths)] if self.api_keys else [])
        app = web.Application(client_max_size=self.config.max_request_bytes, middlewares=middlewares)
        app.add_routes([
            web.post("/v1/chat/completions", self.chat), web.post("/v1/completions", self.completions),
            web.get("/v1/models", self.models), web.post("/generate", self.generate),
            web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize),
            web.get("/health", self.health), web.get("/health_generate", self.health),
            web.get("/livez", self.livez), web.get("/metrics", self.metrics),
            web.get("/get_model_info", self.model_info), web.get("/model_info", self.model_info),
            web.get("/get_server_info", self.server_info), web.get("/server_info", self.server_info),
        ])
        return app

    async def _body(self, request: web.Request) -> dict:
        return await asyncio.to_thread(_json_object, await self._raw(request))
    @property
    def _max_values(self) -> int:
        """More values (commas) than a servable request's body holds: its text's characters (every
        value and key of a chat counts at least one, ChatLimits), its token ids, twice over."""
        return 2 * (self.router.planner.max_chars + self.router.max_model_len) + 4096

    def _limits(self, received: float, cancelled) -> ChatLimits:
        """What one request may cost to prepare: the chat bounds (checked before its template renders;
        none could be served over them) and its deadline (from `received`, time.perf_counter())."""
        planner = self.router.planner
        deadline = time.monotonic() + self.config.prepare_timeout_s - (time.perf_counter() - received)
        return ChatLimits(max_messages=CHAT_MESSAGES_PER_SEGMENT * planner.config.max_segments,
                          max_texts=planner.config.max_segments + 1, max_chars=planner.max_chars,
                          deadline=deadline, cancelled=cancelled)

    async def _off_loop(self, work):
        """work(limits) in a worker thread, bounded by the prepare deadline; cancelled (the client
        gone, the handler cancelled) at its next check."""
        gone = threading.Event()
        limits = self._limits(time.perf_counter(), gone.is_set)
        try:
            return await asyncio.wait_for(asyncio.to_thread(work, limits), self.config.prepare_timeout_s)
        finally:
            gone.set()


    async def _raw(self, request: web.Request) -> bytes:
        """The request's body, bounded in size and time."""
        limit = self.config.max_request_bytes
        if request.content_length is not None and request.content_length > limit:
            raise _Reject(413, f"request body of {request.content_length} bytes exceeds {limit} bytes")
        try:
            raw = await asyncio.wait_for(request.read(), self.config.http_body_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            raise _Reject(413, f"request body exceeds {limit} bytes") from None
        except TimeoutError:
            raise _Reject(408, f"request body not received within {self.config.http_body_timeout_s} s") from None
        if not raw:
            raise _Reject(400, "empty request body")
        return raw

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _Reject(400, "model must be a string")
        if model not in (None, "", "default", self.served_model):
            raise _Reject(404, f"model {model!r} is not served here (serving {self.served_model!r}, alias 'default')")

    async def _handle(self, request: web.Request, convert, respond):
        """`convert(body)`: the native request, or a Fanout of several (n, best_of, prompt lists,
        batches), each streamed by the router in a worker thread of its own (request["runs"], in
        order); `respond(request, reqs, stream, body, fanout)` answers."""
        # the response's ttft_ms counts from here: body, parsing and planning are part of the wait
        received = request["received"] = time.perf_counter()
        try:
            self.router.check_admission()  # a refusal costs no parsing
            raw = await self._raw(request)
        except _Reject as e:
            return _error(e.status, e.message)
        except Overloaded as e:
            return _overloaded(e)
        loop = asyncio.get_running_loop()
        run = _Run(loop)
        request["runs"] = [run]
        self._runs.add(run)
        limits = self._limits(received, lambda: run.control.cancelled)
        tenant = request.get("tenant")

        def prepare():
            # in a worker thread: parsing, conversion (text tokenized) and the router's parse
            body = _json_object(raw, self._max_values)
            self._check_model(body)
            out = convert(body, limits)
            fanout = out if isinstance(out, Fanout) else Fanout([out])
            if self.per_key:
                for native in fanout.requests:
                    native["cache_salt"] = security.tenant_salt(tenant, native.get("cache_salt"))
            reqs = [_parse_named(self.router, native, fanout.prompt_field) for native in fanout.requests]
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise RequestError("stream must be a boolean")
            return body, reqs, stream, fanout

        # the same thread goes on with the router's stream of the first request (its plan, the call
        # to a combine worker); the event loop gets the parsed request once that call is made
        def open_stream(parsed, control, sent, direct):
            return self.router.stream(parsed[1][0], control, received, sent, direct)

        self._workers.submit(functools.partial(run.work, prepare, open_stream))
        try:
            try:
                # past the deadline the answer goes at once; the worker stops at its next check
                body, reqs, stream, fanout = await asyncio.wait_for(
                    asyncio.shield(run.parsed), max(0.0, limits.deadline - time.monotonic()) + 1.0)
            except _Reject as e:
                return _error(e.status, e.message)
            except RequestError as e:
                return _error(400, str(e))
            except (PrepareDeadline, TimeoutError):
                return _error(503, f"the request was not prepared within {self.config.prepare_timeout_s} s "
                              f"(rendered, tokenized, planned); retry later", {"Retry-After": "1"})
            except ServiceUnavailable as e:  # the drain grace ended while it was prepared
                return _error(503, str(e))
            for req in reqs[1:]:
                more = _Run(loop)
                request["runs"].append(more)
                self._runs.add(more)
                self._workers.submit(functools.partial(
                    more.work, functools.partial(lambda r: r, req),
                    lambda r, control, sent, direct: self.router.stream(r, control, received, sent, direct)))
            try:
                return await respond(request, reqs, stream, body, fanout)
            except _Reject as e:
                return _error(e.status, e.message)
            except Overloaded as e:
                return _overloaded(e)
            except ServiceUnavailable as e:
                return _error(503, str(e))
        finally:
            for r in request["runs"]:
                self._runs.discard(r)
                r.close()
            if not run.parsed.done():  # answered before it was parsed (deadline, client gone): nobody reads it
                run.parsed.cancel()

    async def _collect(self, run: _Run) -> tuple[str, list[int], str, dict, list, list]:
        """One request's whole answer: text, token ids, finish reason, stats, per token (id, log p,
        top) when asked, and per prompt token from where asked (log p or None, top)."""
        text, ids, finish, stats, lps, prompt_lps = [], [], "length", {}, [], []
        async with contextlib.aclosing(run.chunks()) as chunks:
            async for c in chunks:
                if c.error:
                    raise _Reject(c.status or 500, c.error)
                if c.done:
                    finish, stats = c.finish_reason, json.loads(c.stats_json or "{}")
                    prompt_lps = _prompt_logprobs_of(c)
                else:
                    text.append(c.text)
                    if c.token_id >= 0:
                        ids.append(c.token_id)
                        if c.has_logprob:
                            lps.append(_logprob_of(c))
        return "".join(text), ids, finish, stats, lps, prompt_lps

    async def _collect_all(self, request: web.Request) -> list[tuple]:
        """Every request's answer (_collect), in order; the first error ends them all."""
        out = await asyncio.gather(*(self._collect(r) for r in request["runs"]))
        metrics.request_answered("http", 200)
        return out

    def _token_text(self, token_id: int) -> str:
        return self.router.planner.tokenizer.tok.decode([token_id], skip_special_tokens=False)

    def _chat_logprobs(self, lps: list) -> dict:
        """OpenAI chat's logprobs object: per token its text, log p, UTF-8 bytes and the top alternatives."""
        def entry(tid, lp):
            t = self._token_text(tid)
            return {"token": t, "logprob": lp, "bytes": list(t.encode())}

        return {"content": [dict(entry(tid, lp), top_logprobs=[entry(i, v) for i, v in top]) for tid, lp, top in lps]}

    def _sglang_logprobs(self, req, lps: list, prompt_lps: list, with_text: bool) -> dict:
        """SGLang's meta_info fields: [log p, token id, text] per output token and per prompt token
        from logprob_start_len (log p None for the prompt's first), and their top alternatives;
        the text only with return_text_in_logprobs."""
        def entry(lp, tid):
            return [lp, tid, self._token_text(tid) if with_text else None]

        start = len(req.prompt_ids) - len(prompt_lps)
        prompt = [(tid, lp, top) for tid, (lp, top) in zip(req.prompt_ids[start:], prompt_lps)]
        return {"output_token_logprobs": [entry(lp, tid) for tid, lp, _ in lps],
                "output_top_logprobs": [[entry(v, i) for i, v in top] for _, _, top in lps],
                "input_token_logprobs": [entry(lp, tid) for tid, lp, _ in prompt],
                "input_top_logprobs": [None if lp is None else [entry(v, i) for i, v in top]
                                       for _, lp, top in prompt]}

    def _completion_logprobs(self, lps: list, offset: int = 0) -> dict:
        """The legacy completions API's logprobs object (tokens, token_logprobs, top_logprobs, text_offset)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lp, top in lps:
            t = self._token_text(tid)
            out["tokens"].append(t)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(None if lp is None else {self._token_text(i): v for i, v in top})
            out["text_offset"].append(offset)
            offset += len(t)
        return out

    async def _sse(self, request: web.Request, event, final=None) -> web.StreamResponse:
        """Stream `event(i, chunk, n_tokens)` payloads (a dict, a list of them, or None) of the
        chunks of every request i of request["runs"] as they come, as server-sent events; then
        final()'s payloads, then [DONE]. The headers go with the first chunk, so that a refusal
        (429, 503) or an error before any token is the response's status."""
        runs = request["runs"]
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, run: _Run) -> None:
            try:
                async with contextlib.aclosing(run.chunks()) as chunks:
                    async for c in chunks:
                        q.put_nowait((i, c))
            except Exception as e:  # noqa: BLE001 - raised where the chunks are read
                q.put_nowait((i, e))
            q.put_nowait((i, _END))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(runs)]
        try:
            i, first = await q.get()
            if isinstance(first, Exception):  # Overloaded, ServiceUnavailable: _handle answers
                raise first
            if first is not _END and first.done and first.error:
                return _error(first.status or 500, first.error)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            n, ended, item = [0] * len(runs), 0, (i, first)
            # the events of every chunk already queued go out in one write: a loop that fell behind
            # (many streams) makes one send a response, not one an event
            pending: list[bytes] = []
            try:
                while True:
                    i, c = item
                    if c is _END:
                        ended += 1
                        if ended == len(runs):
                            break
                    elif isinstance(c, Exception):
                        if pending:
                            await resp.write(b"".join(pending))
                        raise c
                    else:
                        if c.error:
                            payload = {"error": {"message": c.error, "code": c.status or 500}}
                        else:
                            n[i] += c.token_id >= 0 and not c.done
                            payload = event(i, c, n[i])
                        pending.append(_events_bytes(payload))
                    if pending and (q.empty() or len(pending) >= 64):
                        await resp.write(b"".join(pending))
                        pending.clear()
                    item = q.get_nowait() if not q.empty() else await q.get()
                if pending:
                    await resp.write(b"".join(pending))
                if final is not None:
                    await _write_events(resp, final())
                metrics.request_answered("http", 200)
            except (ServiceUnavailable, Overloaded) as e:
                code = 429 if isinstance(e, Overloaded) else 503
                metrics.request_answered("http", code)
                await resp.write(f"data: {json.dumps({'error': {'message': str(e), 'code': code}})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            for t in tasks:
                t.cancel()

    async def drain(self, grace_s: float) -> int:
        """(once the doors stopped listening) Wait up to grace_s for the requests in flight, then end
        those left with an error their clients get (503, or an SSE error event and [DONE]) before
        the connections close. Returns how many were ended so."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self._runs and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = list(self._runs)
        for run in left:
            run.interrupt(Draining())
        deadline = loop.time() + 5.0  # their answers written
        while self._runs and loop.time() < deadline:
            await asyncio.sleep(0.01)
        return len(left)

    def _usage(self, reqs, answers: list[tuple[int, dict]], copies: int = 1) -> dict:
        """usage of the requests, answers[i] = (tokens streamed, stats) of reqs[i]: what the model
        generated (the token that stopped it included), every copy's; each prompt once (its `copies`
        share it), and of it what came from caches filled before this request."""
        firsts = range(0, len(reqs), copies)
        prompt = sum(reqs[k].prompt_len for k in firsts)
        cached = sum(answers[k][1].get("cached_tokens", 0) for k in firsts)
        completion = sum(stats.get("generated_tokens", n) for n, stats in answers)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def chat(self, request):
        def convert(body, limits):
            return chat_requests(body, self.chat_template, self.router.planner.tokenizer,
                                 self.config.segment_separator, limits)

        return await self._handle(request, convert, self._chat_respond)

    async def _chat_respond(self, request, reqs, stream, body, fanout):
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": created, "model": self.served_model}
        # tool calls in the output (Qwen/Hermes <tool_call> blocks) come back as tool_calls
        tools = bool(body.get("tools")) and body.get("tool_choice") != "none" and self.chat_template is not None
        logprobs = reqs[0].sampling.logprobs is not None
        if not stream:
            choices, all_stats = [], []
            for i, (text, ids, finish, stats, lps, _) in enumerate(await self._collect_all(request)):
                stats["chat_template"] = self.chat_template_source
                message = {"role": "assistant", "content": text}
                if tools:
                    content, calls = parse_tool_calls(text)
                    if calls:
                        message = {"role": "assistant", "content": content, "tool_calls": calls}
                        finish = "tool_calls"
                choices.append({"index": i, "message": message, "finish_reason": finish,
                                "logprobs": self._chat_logprobs(lps) if logprobs else None})
                all_stats.append((len(ids), stats))
            return web.json_response(dict(base, object="chat.completion", choices=choices,
                                          usage=self._usage(reqs, all_stats, fanout.copies),
                                          hybridcache=_stats_field(all_stats)))

        # one request without stream_options.include_usage: usage and stats ride on its last chunk
        # (as before OpenAI had include_usage); else they come in a last chunk of their own
        own_usage_chunk = len(reqs) > 1 or _include_usage(body)
        sent = [{"text": "", "out": 0, "role": False} for _ in reqs]
        ended: list = [(0, {})] * len(reqs)

        def delta_of(i: int, content: str) -> dict:
            d = {"content": content}
            if not sent[i]["role"]:
                sent[i]["role"] = True
                d = {"role": "assistant", **d}
            return d

        def event(i, c, n):
            chunk = dict(base, object="chat.completion.chunk")
            st = sent[i]
            if c.done:
                stats = json.loads(c.stats_json or "{}")
                stats["chat_template"] = self.chat_template_source
                ended[i] = (n, stats)
                finish, extra = c.finish_reason, []
                if tools:
                    content, calls = parse_tool_calls(st["text"])
                    if calls:
                        finish = "tool_calls"
                        calls = [dict(call, index=k) for k, call in enumerate(calls)]
                        extra.append({"index": i, "delta": {"tool_calls": calls}, "finish_reason": None})
                    elif len(st["text"]) > st["out"]:  # held back, and no tool call after all
                        extra.append({"index": i, "delta": delta_of(i, st["text"][st["out"]:]),
                                      "finish_reason": None})
                chunk.update(choices=[*extra, {"index": i, "delta": {}, "finish_reason": finish}])
                if not own_usage_chunk:
                    chunk.update(usage=self._usage(reqs, [(n, stats)]), hybridcache=stats)
                return chunk
            st["text"] += c.text
            if tools:
                upto = max(streamable_prefix(st["text"]), st["out"])
                piece, st["out"] = st["text"][st["out"]:upto], upto
                if not piece:
                    return None
            else:
                piece = c.text
            choice = {"index": i, "delta": delta_of(i, piece), "finish_reason": None}
            if c.has_logprob:
                choice["logprobs"] = self._chat_logprobs([_logprob_of(c)])
            chunk.update(choices=[choice])
            return chunk

        def final():
            if not own_usage_chunk:
                return None
            return dict(base, object="chat.completion.chunk", choices=[],
                        usage=self._usage(reqs, ended, fanout.copies), hybridcache=_stats_field(ended))

        return await self._sse(request, event, final)

    async def completions(self, request):
        def convert(body, _limits):
            return completion_requests(body, self.config.segment_separator)

        return await self._handle(request, convert, self._completion_respond)

    async def _completion_respond(self, request, reqs, stream, body, fanout):
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.served_model}
        # the client's logprobs (best_of > n asks for them itself, to rank the candidates)
        logprobs = body.get("logprobs") is not None
        n = body.get("n") or 1
        prompts = prompt_list(body.get("prompt")) if body.get("echo") else None

        def echoed(k: int) -> str:
            """The prompt of request k, as echo returns it (token ids decoded)."""
            p = prompts[k // fanout.copies]
            return p if isinstance(p, str) else self.router.planner.tokenizer.tok.decode(p, skip_special_tokens=False)

        if not stream:
            answers = await self._collect_all(request)
            picked = []
            for g in range(0, len(answers), fanout.copies):
                group = list(range(g, g + fanout.copies))
                if fanout.copies > n:  # best_of: the n with the highest log-probability per token
                    group.sort(key=lambda k: -_mean_logprob(answers[k][4]))
                picked += group[:n]
            choices = []
            for j, k in enumerate(picked):
                text, _, finish, _, lps, prompt_lps = answers[k]
                head = echoed(k) if prompts else ""
                out = None
                if logprobs:
                    # echo: the prompt's tokens first, the first of them without a log-probability
                    entries = [(t, lp, top) for t, (lp, top) in zip(reqs[k].prompt_ids, prompt_lps)]
                    out = self._completion_logprobs(entries + lps)
                choices.append({"index": j, "text": head + text, "finish_reason": finish, "logprobs": out})
            counted = [(len(a[1]), a[3]) for a in answers]
            return web.json_response(dict(base, object="text_completion", choices=choices,
                                          usage=self._usage(reqs, counted, fanout.copies),
                                          hybridcache=_stats_field([counted[k] for k in picked])))

        own_usage_chunk = len(reqs) > 1 or _include_usage(body)
        ended: list = [(0, {})] * len(reqs)
        started = [False] * len(reqs)

        def event(i, c, n_tokens):
            chunk = dict(base, object="text_completion")
            if c.done:
                stats = json.loads(c.stats_json or "{}")
                ended[i] = (n_tokens, stats)
                chunk.update(choices=[{"index": i, "text": "", "finish_reason": c.finish_reason, "logprobs": None}])
                if not own_usage_chunk:
                    chunk.update(usage=self._usage(reqs, [(n_tokens, stats)]), hybridcache=stats)
            else:
                lp = self._completion_logprobs([_logprob_of(c)]) if c.has_logprob and logprobs else None
                text = c.text
                if prompts and not started[i]:  # echo: the prompt goes first
                    text = echoed(i) + text
                started[i] = True
                chunk.update(choices=[{"index": i, "text": text, "finish_reason": None, "logprobs": lp}])
            return chunk

        def final():
            if not own_usage_chunk:
                return None
            return dict(base, object="text_completion", choices=[], usage=self._usage(reqs, ended, fanout.copies),
                        hybridcache=_stats_field(ended))

        return await self._sse(request, event, final)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": self.served_model, "object": "model", "created": 0, "owned_by": "hybridcache",
             "root": self.router.model_name, "parent": None, "max_model_len": self.router.max_model_len}]})

    async def _token_utility(self, request, work, verb: str):
        """/tokenize and /detokenize: `work(raw, limits)` off the event loop (the body parsed there
        too: its objects are made and freed in the worker), its errors as HTTP answers."""
        try:
            raw = await self._raw(request)
            return web.Response(body=await self._off_loop(functools.partial(work, raw)),
                                content_type="application/json")
        except _Reject as e:
            return _error(e.status, e.message)
        except RequestError as e:
            return _error(400, str(e))
        except (PrepareDeadline, TimeoutError):
            return _error(503, f"not {verb} within {self.config.prepare_timeout_s} s; retry later",
                          {"Retry-After": "1"})

    async def tokenize(self, request):
        """vLLM's /tokenize: {"prompt"} or {"messages"} (rendered as /v1/chat/completions renders them).
        Bounded as a completion is: the body's size, the characters tokenized, the chat's size before
        it renders; the work runs off the event loop."""
        return await self._token_utility(request, self._tokenize, "tokenized")

    def _tokenize(self, raw: bytes, limits: ChatLimits) -> bytes:
        body = _json_object(raw, self._max_values)
        self._check_model(body)
        tok = self.router.planner.tokenizer
        if "messages" in body:
            _check_keys(body, {"model", "messages", "add_generation_prompt", "add_special_tokens", "tools"})
            if body.get("add_generation_prompt", True) is not True:
                raise RequestError("add_generation_prompt must be true (the prompts served end with it)")
            native = chat_to_native({k: body[k] for k in ("messages", "tools") if k in body},
                                    self.chat_template, tok, self.config.segment_separator, limits)
            texts = [p for p in (native["system"], *native["segments"], native["suffix"]) if isinstance(p, str)]
            if sum(map(len, texts)) > limits.max_chars:
                raise RequestError(f"the messages hold more than {limits.max_chars} characters, more than could "
                                   f"fit in the served length")
            tokens = [t for part in (native["system"], *native["segments"], native["suffix"])
                      for t in (tok.encode(part) if isinstance(part, str) else part)]
        else:
            _check_keys(body, {"model", "prompt", "add_special_tokens"})
            prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
            if not isinstance(prompt, str) or not isinstance(special, bool):
                raise RequestError("prompt must be a string and add_special_tokens a boolean")
            if len(prompt) > limits.max_chars:
                raise RequestError(f"the prompt has {len(prompt)} characters, more than the {limits.max_chars} "
                                   f"that could fit in the served length")
            limits.check()
            tokens = tok.encode_with_offsets(prompt, add_special_tokens=special).ids
        return orjson.dumps({"count": len(tokens), "max_model_len": self.router.max_model_len,
                             "tokens": tokens, "token_strs": None})

    async def detokenize(self, request):
        """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}, special tokens kept; at most the
        served length of ids, decoded off the event loop."""
        return await self._token_utility(request, self._detokenize, "detokenized")

    def _detokenize(self, raw: bytes, limits: ChatLimits) -> bytes:
        body = _json_object(raw, self._max_values)
        self._check_model(body)
        _check_keys(body, {"model", "tokens"})
        tokens, vocab, most = body.get("tokens"), self.router.planner.cfg.vocab_size, self.router.max_model_len
        if isinstance(tokens, list) and len(tokens) > most:
            raise RequestError(f"tokens holds {len(tokens)} ids, more than the served max model length ({most})")
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
            raise RequestError(f"tokens must be a list of token ids in [0, {vocab})")
        limits.check()
        return orjson.dumps({"prompt": self.router.planner.tokenizer.tok.decode(tokens, skip_special_tokens=False)})

    async def generate(self, request):
        def convert(body, _limits):
            return sglang_requests(body, self.config.segment_separator)

        return await self._handle(request, convert, self._generate_respond)

    def _meta(self, prompt_tokens: int, n: int, finish: str | None, stats: dict, t0: float) -> dict:
        meta = {"prompt_tokens": prompt_tokens, "completion_tokens": stats.get("generated_tokens", n),
                "cached_tokens": stats.get("cached_tokens", 0), "e2e_latency": time.perf_counter() - t0}
        meta["finish_reason"] = None if finish is None else {"type": finish}
        return meta

    async def _generate_respond(self, request, reqs, stream, body, fanout):
        """SGLang's answer: one object, or a list of them in request order (a batch of texts, n > 1)."""
        t0 = time.perf_counter()
        if not stream:
            outs = []
            with_text = body.get("return_text_in_logprobs") is True
            for req, (text, ids, finish, stats, lps, prompt_lps) in zip(reqs, await self._collect_all(request)):
                meta = self._meta(req.prompt_len, len(ids), finish, stats, t0)
                if req.sampling.logprobs is not None:
                    meta.update(self._sglang_logprobs(req, lps, prompt_lps, with_text))
                outs.append({"text": text, "output_ids": ids, "meta_info": meta,
                             "usage": self._usage([req], [(len(ids), stats)]), "hybridcache": stats})
            return web.json_response(outs if fanout.listed else outs[0])
        text, ids, lps = ([[] for _ in reqs] for _ in range(3))
        with_text = body.get("return_text_in_logprobs") is True
        prompt_lens = [req.prompt_len for req in reqs]

        def event(i, c, n):
            # SGLang streams the text so far in every chunk (a batch's with their index)
            req = reqs[i]
            index = {"index": i} if fanout.listed else {}
            if c.done:
                stats = json.loads(c.stats_json or "{}")
                meta = self._meta(prompt_lens[i], n, c.finish_reason, stats, t0)
                if req.sampling.logprobs is not None:
                    meta.update(self._sglang_logprobs(req, lps[i], _prompt_logprobs_of(c), with_text))
                return {"text": "".join(text[i]), "output_ids": ids[i], "usage": self._usage([req], [(n, stats)]),
                        "meta_info": meta, "hybridcache": stats, **index}
            text[i].append(c.text)
            if c.token_id >= 0:
                ids[i].append(c.token_id)
                if c.has_logprob:
                    lps[i].append(_logprob_of(c))
            meta = self._meta(prompt_lens[i], n, None, {}, t0)
            if req.sampling.logprobs is not None:
                meta.update(self._sglang_logprobs(req, lps[i], [], with_text))
            # the output so far, not a copy: _sse encodes an event as soon as it is made
            return {"text": "".join(text[i]), "output_ids": ids[i], "meta_info": meta, **index}

        return await self._sse(request, event)

    async def model_info(self, request):
        return web.json_response({"model_path": self.served_model, "tokenizer_path": self.served_model,
                                  "is_generation": True, "preferred_sampling_params": None})

    async def server_info(self, request):
        info = self.router.info
        return web.json_response({"model_path": self.served_model, "version": "hybridcache-0.1.0",
                                  "seam_window": info.seam_window if info else None,
                                  "mode": info.mode if info else None,
                                  "cold_segment_queue_depth": self.router.cold_queue_depth})

    async def livez(self, request):
        """Liveness: the process serves HTTP. Readiness (/health) also needs a combine worker."""
        return web.json_response({"status": "alive", "role": "router"})

    async def health(self, request):
        ready = self.router.info is not None
        return web.json_response({"status": "ok" if ready else "waiting for a combine worker", "role": "router",
                                  "directory": self.router.directory.backend,
                                  "cold_segment_queue_depth": self.router.cold_queue_depth},
                                 status=200 if ready else 503)

    async def metrics(self, request):
        return web.Response(body=metrics.scrape(), content_type="text/plain", charset="utf-8")


_ORJSON_OPTS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def _json_bytes(obj) -> bytes:
    """obj as JSON: orjson (SGLang's streamed events repeat the output so far, so a long stream's
    events grow with it: orjson encodes their id lists many times faster than json.dumps), json.dumps
    for what orjson refuses (a str that is not valid UTF-8, an int past 64 bits)."""
    try:
        return orjson.dumps(obj, option=_ORJSON_OPTS)
    except TypeError:  # orjson.JSONEncodeError is one
        return json.dumps(obj).encode()


def _events_bytes(payload) -> bytes:
    """A payload (a dict, a list of them, or None) as server-sent events."""
    return b"".join(b"data: " + _json_bytes(p) + b"\n\n"
                    for p in (payload if isinstance(payload, list) else [] if payload is None else [payload]))


async def _write_events(resp: web.StreamResponse, payload) -> None:
    """Write a payload (a dict, a list of them, or None) as server-sent events."""
    data = _events_bytes(payload)
    if data:
        await resp.write(data)


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _stats_field(answers: list) -> dict | list:
    """The `hybridcache` object: one request's stats, or the list of each request's ((n, stats) pairs)."""
    stats = [st for _, st in answers]
    return stats[0] if len(stats) == 1 else stats


def _mean_logprob(lps: list) -> float:
    """The log-probability per token of an output (best_of's ranking); 0 for an empty one."""
    return sum(lp for _, lp, _ in lps) / len(lps) if lps else 0.0


def _parse_named(router: Router, native: dict, prompt_field: str | None):
    """router.parse of a native request, a refusal of its suffix naming the field the client sent."""
    try:
        return router.parse(native, json_ids=True)
    except RequestError as e:
        message = str(e)
        if prompt_field and message.startswith("suffix "):
            raise RequestError(prompt_field + message[len("suffix"):]) from None
        raise


def _logprob_of(c) -> tuple[int, float, list[tuple[int, float]]]:
    return c.token_id, c.logprob, list(zip(c.top_ids, c.top_logprobs))


def _prompt_logprobs_of(c) -> list[tuple[float | None, list[tuple[int, float]]]]:
    """A done chunk's prompt log-probabilities: (log p, or None for the prompt's first token, and
    the alternatives) per prompt token from where they were asked."""
    values = list(c.prompt_logprobs)
    if not values:
        return []
    known = sum(not math.isnan(v) for v in values)
    k = len(c.prompt_top_ids) // known if known else 0
    out, at = [], 0
    for v in values:
        if math.isnan(v):
            out.append((None, []))
            continue
        out.append((v, list(zip(c.prompt_top_ids[at:at + k], c.prompt_top_logprobs[at:at + k]))))
        at += k
    return out


def _check_keys(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unknown field(s) in the request: {', '.join(unknown)}")


class _Reject(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message
