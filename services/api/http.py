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
import contextlib
import functools
import json
import logging
import math
import queue
import threading
import time
import uuid

import orjson
from aiohttp import web
from hybridcache.services import security
from hybridcache.services.api.chat_template import ChatLimits, ChatTemplate, PrepareDeadline
from hybridcache.services.api.openai_compat import (
    NO_TEMPLATE,
    chat_to_native,
    completion_to_native,
    parse_tool_calls,
    sglang_to_native,
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
    metrics.REQUESTS.labels(status=str(status)).inc()
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
        self.parsed: asyncio.Future = loop.create_future()
        self._q: asyncio.Queue = asyncio.Queue()
        self.control = StreamControl()
        self.done = False

    def _call(self, fn, *args) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    def _settle(self, result=None, error: BaseException | None = None) -> None:
        if not self.parsed.done():  # cancelled with its handler
            if error is not None:
                self.parsed.set_exception(error)
            else:
                self.parsed.set_result(result)

    def work(self, prepare, stream) -> None:
        """(in the worker thread) parsed = prepare(); then the chunks of stream(parsed, control,
        sent), `sent` a callable that hands `parsed` to the event loop (at most once)."""
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
            for chunk in stream(parsed, self.control, hand):
                hand()
                self._call(self._q.put_nowait, chunk)
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
        # the response's ttft_ms counts from here: body, parsing and planning are part of the wait
        received = request["received"] = time.perf_counter()
        try:
            self.router.check_admission()  # a refusal costs no parsing
            raw = await self._raw(request)
        except _Reject as e:
            return _error(e.status, e.message)
        except Overloaded as e:
            return _overloaded(e)

        run = request["run"] = _Run(asyncio.get_running_loop())
        self._runs.add(run)
        limits = self._limits(received, lambda: run.control.cancelled)
        tenant = request.get("tenant")

        def prepare():
            # in a worker thread: parsing, conversion (text tokenized) and the router's parse
            body = _json_object(raw, self._max_values)
            self._check_model(body)
            native = convert(body, limits)
            if self.per_key:
                native["cache_salt"] = security.tenant_salt(tenant, native.get("cache_salt"))
            req = self.router.parse(native, json_ids=True)
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise RequestError("stream must be a boolean")
            return body, req, stream

        # the same thread goes on with the router's stream of the request (its plan, the call to
        # a combine worker); the event loop gets the parsed request once that call is made
        def open_stream(parsed, control, sent):
            return self.router.stream(parsed[1], control, received, sent)

        self._workers.submit(functools.partial(run.work, prepare, open_stream))
        try:
            try:
                # past the deadline the answer goes at once; the worker stops at its next check
                body, req, stream = await asyncio.wait_for(asyncio.shield(run.parsed),
                                                           max(0.0, limits.deadline - time.monotonic()) + 1.0)
            except _Reject as e:
                return _error(e.status, e.message)
            except RequestError as e:
                return _error(400, str(e))
            except (PrepareDeadline, TimeoutError):
                return _error(503, f"the request was not prepared within {self.config.prepare_timeout_s} s "
                              f"(rendered, tokenized, planned); retry later", {"Retry-After": "1"})
            except ServiceUnavailable as e:  # the drain grace ended while it was prepared
                return _error(503, str(e))
            try:
                return await respond(request, req, stream, body)
            except _Reject as e:
                return _error(e.status, e.message)
            except Overloaded as e:
                return _overloaded(e)
            except ServiceUnavailable as e:
                return _error(503, str(e))
        finally:
            self._runs.discard(run)
            run.close()
            if not run.parsed.done():  # answered before it was parsed (deadline, client gone): nobody reads it
                run.parsed.cancel()

    async def _collect(self, request: web.Request, req) -> tuple[str, list[int], str, dict, list]:
        """The whole answer: text, token ids, finish reason, stats and per token (id, log p, top) when asked."""
        text, ids, finish, stats, lps = [], [], "length", {}, []
        async with contextlib.aclosing(request["run"].chunks()) as chunks:
            async for c in chunks:
                if c.error:
                    raise _Reject(c.status or 500, c.error)
                if c.done:
                    finish, stats = c.finish_reason, json.loads(c.stats_json or "{}")
                else:
                    text.append(c.text)
                    if c.token_id >= 0:
                        ids.append(c.token_id)
                        if c.has_logprob:
                            lps.append(_logprob_of(c))
        metrics.REQUESTS.labels(status="200").inc()
        return "".join(text), ids, finish, stats, lps

    def _token_text(self, token_id: int) -> str:
        return self.router.planner.tokenizer.tok.decode([token_id], skip_special_tokens=False)

    def _chat_logprobs(self, lps: list) -> dict:
        """OpenAI chat's logprobs object: per token its text, log p, UTF-8 bytes and the top alternatives."""
        def entry(tid, lp):
            t = self._token_text(tid)
            return {"token": t, "logprob": lp, "bytes": list(t.encode())}

        return {"content": [dict(entry(tid, lp), top_logprobs=[entry(i, v) for i, v in top]) for tid, lp, top in lps]}

    def _completion_logprobs(self, lps: list, offset: int = 0) -> dict:
        """The legacy completions API's logprobs object (tokens, token_logprobs, top_logprobs, text_offset)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lp, top in lps:
            t = self._token_text(tid)
            out["tokens"].append(t)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({self._token_text(i): v for i, v in top})
            out["text_offset"].append(offset)
            offset += len(t)
        return out

    async def _sse(self, request: web.Request, req, event) -> web.StreamResponse:
        """Stream `event(chunk, n_tokens)` dicts as server-sent events, then [DONE]. The headers
        go with the first chunk, so that a refusal (429, 503) or an error before any token is the
        response's status."""
        async with contextlib.aclosing(request["run"].chunks()) as chunks:
            first = await anext(chunks, None)  # Overloaded, ServiceUnavailable: _handle answers
            if first is not None and first.done and first.error:
                return _error(first.status or 500, first.error)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            n = 0
            try:
                c = first
                while c is not None:
                    if c.error:
                        payload = {"error": {"message": c.error, "code": c.status or 500}}
                    else:
                        n += c.token_id >= 0 and not c.done
                        payload = event(c, n)
                    if payload is not None:
                        await resp.write(f"data: {json.dumps(payload)}\n\n".encode())
                    c = await anext(chunks, None)
                metrics.REQUESTS.labels(status="200").inc()
            except (ServiceUnavailable, Overloaded) as e:
                code = 429 if isinstance(e, Overloaded) else 503
                metrics.REQUESTS.labels(status=str(code)).inc()
                await resp.write(f"data: {json.dumps({'error': {'message': str(e), 'code': code}})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        return resp

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

    def _usage(self, req, completion_tokens: int, stats: dict) -> dict:
        # what the model generated (the token that stopped it included), and of the prompt what
        # came from caches filled before this request
        prompt = req.prompt_len
        completion_tokens = stats.get("generated_tokens", completion_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": stats.get("cached_tokens", 0)}}

    async def chat(self, request):
        def convert(body, limits):
            return chat_to_native(body, self.chat_template, self.router.planner.tokenizer, limits)

        return await self._handle(request, convert, self._chat_respond)

    async def _chat_respond(self, request, req, stream, body):
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": created, "model": self.served_model}
        # tool calls in the output (Qwen/Hermes <tool_call> blocks) come back as tool_calls
        tools = bool(body.get("tools")) and body.get("tool_choice") != "none" and self.chat_template is not None
        if not stream:
            text, ids, finish, stats, lps = await self._collect(request, req)
            stats["chat_template"] = self.chat_template_source
            message = {"role": "assistant", "content": text}
            if tools:
                content, calls = parse_tool_calls(text)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    finish = "tool_calls"
            return web.json_response(dict(base, object="chat.completion", choices=[
                {"index": 0, "message": message, "finish_reason": finish,
                 "logprobs": self._chat_logprobs(lps) if req.sampling.logprobs is not None else None}],
                usage=self._usage(req, len(ids), stats), hybridcache=stats))

        sent = {"text": "", "out": 0, "role": False}

        def delta_of(content: str) -> dict:
            d = {"content": content}
            if not sent["role"]:
                sent["role"] = True
                d = {"role": "assistant", **d}
            return d

        def event(c, n):
            chunk = dict(base, object="chat.completion.chunk")
            if c.done:
                stats = json.loads(c.stats_json or "{}")
                stats["chat_template"] = self.chat_template_source
                finish, extra = c.finish_reason, []
                if tools:
                    content, calls = parse_tool_calls(sent["text"])
                    if calls:
                        finish = "tool_calls"
                        calls = [dict(call, index=i) for i, call in enumerate(calls)]
                        extra.append({"index": 0, "delta": {"tool_calls": calls}, "finish_reason": None})
                    elif len(sent["text"]) > sent["out"]:  # held back, and no tool call after all
                        extra.append({"index": 0, "delta": delta_of(sent["text"][sent["out"]:]),
                                      "finish_reason": None})
                chunk.update(choices=[*extra, {"index": 0, "delta": {}, "finish_reason": finish}],
                             usage=self._usage(req, n, stats), hybridcache=stats)
                return chunk
            sent["text"] += c.text
            if tools:
                upto = max(streamable_prefix(sent["text"]), sent["out"])
                piece, sent["out"] = sent["text"][sent["out"]:upto], upto
                if not piece:
                    return None
            else:
                piece = c.text
            choice = {"index": 0, "delta": delta_of(piece), "finish_reason": None}
            if c.has_logprob:
                choice["logprobs"] = self._chat_logprobs([_logprob_of(c)])
            chunk.update(choices=[choice])
            return chunk

        return await self._sse(request, req, event)

    async def completions(self, request):
        return await self._handle(request, lambda body, _limits: completion_to_native(body),
                                  self._completion_respond)

    async def _completion_respond(self, request, req, stream, body):
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.served_model}
        if not stream:
            text, ids, finish, stats, lps = await self._collect(request, req)
            logprobs = self._completion_logprobs(lps) if req.sampling.logprobs is not None else None
            return web.json_response(dict(base, object="text_completion", choices=[
                {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}],
                usage=self._usage(req, len(ids), stats), hybridcache=stats))

        def event(c, n):
            chunk = dict(base, object="text_completion")
            if c.done:
                stats = json.loads(c.stats_json or "{}")
                chunk.update(choices=[{"index": 0, "text": "", "finish_reason": c.finish_reason, "logprobs": None}],
                             usage=self._usage(req, n, stats), hybridcache=stats)
            else:
                logprobs = self._completion_logprobs([_logprob_of(c)]) if c.has_logprob else None
                chunk.update(choices=[{"index": 0, "text": c.text, "finish_reason": None, "logprobs": logprobs}])
            return chunk

        return await self._sse(request, req, event)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": self.served_model, "object": "model", "created": 0, "owned_by": "hybridcache",
             "root": self.router.model_name, "parent": None, "max_model_len": self.router.max_model_len}]})

    async def tokenize(self, request):
        """vLLM's /tokenize: {"prompt"} or {"messages"} (rendered as /v1/chat/completions renders them).
        Bounded as a completion is: the body's size, the characters tokenized, the chat's size before
        it renders; the work runs off the event loop."""
        try:
            # parsed in the worker too: the body's objects are made and freed there, not on the event loop
            raw = await self._raw(request)
            return web.Response(body=await self._off_loop(functools.partial(self._tokenize, raw)),
                                content_type="application/json")
        except _Reject as e:
            return _error(e.status, e.message)
        except RequestError as e:
            return _error(400, str(e))
        except (PrepareDeadline, TimeoutError):
            return _error(503, f"not tokenized within {self.config.prepare_timeout_s} s; retry later",
                          {"Retry-After": "1"})

    def _tokenize(self, raw: bytes, limits: ChatLimits) -> bytes:
        body = _json_object(raw, self._max_values)
        self._check_model(body)
        tok = self.router.planner.tokenizer
        if "messages" in body:
            _check_keys(body, {"model", "messages", "add_generation_prompt", "add_special_tokens", "tools"})
            if body.get("add_generation_prompt", True) is not True:
                raise RequestError("add_generation_prompt must be true (the prompts served end with it)")
            native = chat_to_native({k: body[k] for k in ("messages", "tools") if k in body},
                                    self.chat_template, tok, limits)
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
        try:
            # parsed in the worker too: the body's objects are made and freed there, not on the event loop
            raw = await self._raw(request)
            return web.Response(body=await self._off_loop(functools.partial(self._detokenize, raw)),
                                content_type="application/json")
        except _Reject as e:
            return _error(e.status, e.message)
        except RequestError as e:
            return _error(400, str(e))
        except (PrepareDeadline, TimeoutError):
            return _error(503, f"not detokenized within {self.config.prepare_timeout_s} s; retry later",
                          {"Retry-After": "1"})

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
        return await self._handle(request, lambda body, _limits: sglang_to_native(body), self._generate_respond)

    def _meta(self, req, n: int, finish: str | None, stats: dict, t0: float) -> dict:
        meta = {"prompt_tokens": req.prompt_len, "completion_tokens": stats.get("generated_tokens", n),
                "cached_tokens": stats.get("cached_tokens", 0), "e2e_latency": time.perf_counter() - t0}
        meta["finish_reason"] = None if finish is None else {"type": finish}
        return meta

    async def _generate_respond(self, request, req, stream, body):
        t0 = time.perf_counter()
        if not stream:
            text, ids, finish, stats, lps = await self._collect(request, req)
            meta = self._meta(req, len(ids), finish, stats, t0)
            if req.sampling.logprobs is not None:
                meta.update(_sglang_logprobs(lps))
            return web.json_response({"text": text, "output_ids": ids, "meta_info": meta,
                                      "usage": self._usage(req, len(ids), stats), "hybridcache": stats})
        text, ids, lps = [], [], []

        def event(c, n):
            # SGLang streams the text so far in every chunk.
            if c.done:
                stats = json.loads(c.stats_json or "{}")
                meta = self._meta(req, n, c.finish_reason, stats, t0)
                if req.sampling.logprobs is not None:
                    meta.update(_sglang_logprobs(lps))
                return {"text": "".join(text), "output_ids": ids, "usage": self._usage(req, n, stats),
                        "meta_info": meta, "hybridcache": stats}
            text.append(c.text)
            if c.token_id >= 0:
                ids.append(c.token_id)
                if c.has_logprob:
                    lps.append(_logprob_of(c))
            meta = self._meta(req, n, None, {}, t0)
            if req.sampling.logprobs is not None:
                meta.update(_sglang_logprobs(lps))
            return {"text": "".join(text), "output_ids": list(ids), "meta_info": meta}

        return await self._sse(request, req, event)

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


def _logprob_of(c) -> tuple[int, float, list[tuple[int, float]]]:
    return c.token_id, c.logprob, list(zip(c.top_ids, c.top_logprobs))


def _sglang_logprobs(lps: list) -> dict:
    """SGLang's meta_info fields: (log p, token id, text) per output token, and the top alternatives."""
    return {"output_token_logprobs": [[lp, tid, None] for tid, lp, _ in lps],
            "output_top_logprobs": [[[v, i, None] for i, v in top] for _, _, top in lps]}


def _check_keys(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unknown field(s) in the request: {', '.join(unknown)}")


class _Reject(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message
