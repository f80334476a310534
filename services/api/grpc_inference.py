"""gRPC `hybridcache.v1.Inference/Generate` on the router: a native request in, a token stream out."""

from __future__ import annotations

import json

from hybridcache.services.protocol import pb, rpc
from hybridcache.services.router.router import Router, ServiceUnavailable
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
        try:
            yield from self.router.stream(req)
        except ServiceUnavailable as e:
            yield pb.TokenChunk(done=True, error=str(e), status=503)
