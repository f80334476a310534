"""gRPC `hybridcache.v1.Inference/Generate` on the router: a native request in, a token stream out.
A full queue ends the call with RESOURCE_EXHAUSTED (trailing metadata `retry-after`, seconds); a
client that cancels the call cancels its request on the combine worker."""

from __future__ import annotations

import json
import math

import grpc
from hybridcache.services.protocol import pb, rpc
from hybridcache.services.router.router import Overloaded, Router, ServiceUnavailable, StreamControl
from hybridcache.services.runtime.sampling import RequestError


class InferenceServicer(rpc.InferenceServicer):
    def __init__(self, router: Router):
        self.router = router

    def Generate(self, request, context):
        try:
            obj = json.loads(request.request_json or "null")
            req = self.router.parse(obj)
        except (json.JSONDecodeError, RequestError) as e:
            yield pb.TokenChunk(done=True, error=str(e), status=400)
            return
        control = StreamControl()
        context.add_callback(control.cancel)
        try:
            yield from self.router.stream(req, control)
        except Overloaded as e:
            context.set_trailing_metadata((("retry-after", str(math.ceil(e.retry_after_s))),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ServiceUnavailable as e:
            yield pb.TokenChunk(done=True, error=str(e), status=503)
