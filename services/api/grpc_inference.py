"""gRPC `hybridcache.v1.Inference/Generate` on the router: a native request in, a token stream out.

Errors end the call with a status and its message, never inside an OK stream: a bad request is
INVALID_ARGUMENT, a full queue on the combine worker RESOURCE_EXHAUSTED (trailing metadata
`retry-after`, seconds), no combine worker UNAVAILABLE (the server itself refuses a message over
--max-request-bytes with RESOURCE_EXHAUSTED before it is parsed). Tokens already streamed stay
streamed; the status comes after them. A client that cancels the call cancels its request on the
combine worker.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time

import grpc
from hybridcache.services import security
from hybridcache.services.api.openai_compat import split_native
from hybridcache.services.observability import metrics
from hybridcache.services.protocol import rpc
from hybridcache.services.router.router import Overloaded, Router, ServiceUnavailable, StreamControl
from hybridcache.services.runtime.sampling import RequestError

log = logging.getLogger("hybridcache.grpc")

DRAINING = ("the server is shutting down and this request did not finish within its drain grace; retry elsewhere "
            "or later")

# The HTTP-like status a combine worker puts on an error chunk, as a gRPC status.
STATUS_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
                413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
                503: grpc.StatusCode.UNAVAILABLE}


def _parse_json(text: str):
    try:
        return json.loads(text or "null")
    except json.JSONDecodeError as e:
        raise RequestError(f"request_json is not valid JSON: {e}") from None
    except RecursionError:
        raise RequestError("request_json is nested too deeply") from None


class InferenceServicer(rpc.InferenceServicer):
    def __init__(self, router: Router, api_keys: list[str] | None = None):
        self.router = router
        # --cache-isolation per-key: "Bearer KEY" -> the key's client (its requests' cache salt)
        self._tenants = {}
        if router.runtime.cache_isolation == "per-key":
            self._tenants = {f"Bearer {k}": security.tenant_of(k) for k in api_keys or ()}
        self._active: set[StreamControl] = set()  # calls in flight (drain ends those left)
        self._lock = threading.Lock()
        self._draining = False

    def Generate(self, request, context):
        # context.abort raises a bare Exception: the status is decided first, aborted with once
        control = StreamControl()
        if not context.add_callback(control.cancel):  # the call has ended already
            control.cancel()
        with self._lock:
            self._active.add(control)
        try:
            yield from self._generate(request, control, self._tenant(context))
            if not (self._draining and control.cancelled):
                metrics.grpc_answered("CANCELLED" if control.cancelled else "OK")
                return
            code, message = grpc.StatusCode.UNAVAILABLE, DRAINING
        except GeneratorExit:  # the client went away mid-stream
            metrics.grpc_answered("CANCELLED")
            raise
        except _Status as e:
            code, message = e.code, e.message
        except Overloaded as e:
            context.set_trailing_metadata((("retry-after", str(math.ceil(e.retry_after_s))),))
            code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
        except Exception as e:  # noqa: BLE001 - a fault of this server: logged, answered INTERNAL
            log.exception("Generate failed")
            code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}"
        finally:
            with self._lock:
                self._active.discard(control)
        metrics.grpc_answered(code.name)
        context.abort(code, message)

    def drain(self, grace_s: float) -> int:
        """(the server no longer takes calls) Wait up to grace_s for the calls in flight, then end
        those left with UNAVAILABLE (the server's own stop must give them a little longer). Returns
        how many were ended so."""
        deadline = time.monotonic() + grace_s
        while self._active and time.monotonic() < deadline:
            time.sleep(0.05)
        self._draining = True
        with self._lock:
            left = list(self._active)
        for control in left:
            control.cancel()
        return len(left)

    def _tenant(self, context) -> str | None:
        """The client of the call's API key under --cache-isolation per-key (the interceptor let
        through only calls with a key), else None."""
        if not self._tenants:
            return None
        auth = dict(context.invocation_metadata() or ()).get("authorization", "")
        return self._tenants.get(auth)

    def _generate(self, request, control: StreamControl, tenant: str | None = None):
        try:
            self.router.check_admission()  # a refusal costs no parsing
            native = split_native(_parse_json(request.request_json), self.router.runtime.segment_separator)
            if tenant is not None and isinstance(native, dict):
                native["cache_salt"] = security.tenant_salt(tenant, native.get("cache_salt"))
            req = self.router.parse(native, json_ids=True)
            for chunk in self.router.stream(req, control):
                if chunk.error:
                    raise _Status(STATUS_CODES.get(chunk.status, grpc.StatusCode.INTERNAL), chunk.error)
                yield chunk
        except RequestError as e:
            raise _Status(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except ServiceUnavailable as e:
            raise _Status(grpc.StatusCode.UNAVAILABLE, str(e)) from None


class _Status(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message
