"""The deployment secret and what derives from it: the token every internal gRPC call carries and
the key every cache entry is sealed with.

One secret per deployment, shared by its members and nobody else: `hybridcache up` makes one per
run and hands it to its children in a file (`--secret-file`); the operator keeps it in a Secret
mounted into every pod. The gRPC token and the sealing key are HMACs of the secret under distinct
labels, so a token seen on the wire does not give away the key that seals entries.

    secret = DeploymentSecret.load(path)      # or DeploymentSecret.generate()
    install(secret)                           # this process seals and checks entries with it
    channel = internal_channel(address)       # every call carries the token
    server = grpc.server(..., interceptors=[TokenInterceptor(secret.token)])
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import grpc

TOKEN_METADATA = "x-hybridcache-token"
# Internal messages carry whole tensors (one K/V layer of a long segment is tens of MiB). A peer
# that restarts is dialled again within two seconds (gRPC's default backoff grows to two minutes).
INTERNAL_GRPC_OPTIONS = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30),
                         ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                         ("grpc.max_reconnect_backoff_ms", 2000)]
SECRET_BYTES = 32


class SecretError(ValueError):
    """The deployment secret is missing or unreadable (a usage error: exit 2)."""


@dataclass(frozen=True)
class DeploymentSecret:
    secret: bytes

    def __post_init__(self):
        if len(self.secret) < 16:
            raise SecretError("the deployment secret must hold at least 16 bytes")

    @classmethod
    def generate(cls) -> DeploymentSecret:
        return cls(secrets.token_hex(SECRET_BYTES).encode())

    @classmethod
    def load(cls, path: str | Path) -> DeploymentSecret:
        try:
            raw = Path(path).read_bytes().strip()
        except OSError as e:
            raise SecretError(f"cannot read the deployment secret {path}: {e.strerror}") from None
        return cls(raw)

    def write(self, path: str | Path) -> Path:
        """Write the secret to `path`, readable by its owner only."""
        return write_private(path, self.secret)

    def _derive(self, label: bytes) -> bytes:
        return hmac.new(self.secret, b"hybridcache|" + label, hashlib.sha256).digest()

    @property
    def token(self) -> str:
        """What internal gRPC calls carry in their TOKEN_METADATA."""
        return self._derive(b"grpc-token").hex()

    @property
    def seal_key(self) -> bytes:
        """The HMAC key of cache entries (cache/entry.py)."""
        return self._derive(b"entry-seal")


def write_private(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` readable and writable by this process's user alone (0600, also when
    the file was there with another mode: its mode is set before anything is written)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(data)
    return path


_installed: DeploymentSecret | None = None


def install(secret: DeploymentSecret | None) -> None:
    """Make `secret` this process's: entries are sealed and checked with its key, internal channels
    carry its token. None uninstalls (entries are then sealed with an empty key: an integrity check
    only, which is what a single process with no peers needs)."""
    global _installed
    _installed = secret


def installed() -> DeploymentSecret | None:
    return _installed


def seal_key() -> bytes:
    return _installed.seal_key if _installed is not None else b""


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class TokenClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                             grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the token to the metadata of every call of a channel."""

    def __init__(self, token: str):
        self._pair = (TOKEN_METADATA, token)

    def _details(self, d):
        metadata = [*(d.metadata or ()), self._pair]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def retry_unavailable(service: str, attempts: int = 5) -> tuple[str, str]:
    """The channel option that has gRPC retry calls of `service` that fail UNAVAILABLE before any
    answer (a peer restarting: the channel reconnects within its backoff), for about 3 s."""
    policy = {"maxAttempts": attempts, "initialBackoff": "0.25s", "maxBackoff": "1s", "backoffMultiplier": 2,
              "retryableStatusCodes": ["UNAVAILABLE"]}
    return "grpc.service_config", json.dumps({"methodConfig": [{"name": [{"service": service}],
                                                                "retryPolicy": policy}]})


def internal_channel(address: str, options: list | tuple = ()) -> grpc.Channel:
    """A channel to another member of the deployment; its calls carry the installed secret's token."""
    channel = grpc.insecure_channel(address, options=[*INTERNAL_GRPC_OPTIONS, *options])
    if _installed is None:
        return channel
    return grpc.intercept_channel(channel, TokenClientInterceptor(_installed.token))


def _abort_handler(handler, code: grpc.StatusCode, message: str):
    """A handler of the same streaming kind as `handler` that ends the call with `code`."""

    def abort(_request, context):
        context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class MetadataCheckInterceptor(grpc.ServerInterceptor):
    """Ends with UNAUTHENTICATED every call whose `header` metadata is none of `expected` (each
    compared in constant time) before the service sees its request."""

    def __init__(self, header: str, expected: str | list[str], message: str):
        expected = [expected] if isinstance(expected, str) else expected
        self._header, self._expected, self._message = header, [e.encode() for e in expected], message

    def intercept_service(self, continuation, handler_call_details):
        got = ""
        for k, v in handler_call_details.invocation_metadata or ():
            if k == self._header:
                got = v
        handler = continuation(handler_call_details)
        if handler is None or matches(got.encode(), self._expected):
            return handler
        from hybridcache.services.observability import metrics

        metrics.UNAUTHENTICATED.labels(door="grpc").inc()
        return _abort_handler(handler, grpc.StatusCode.UNAUTHENTICATED, self._message)


def TokenInterceptor(token: str) -> MetadataCheckInterceptor:  # noqa: N802 - reads as a class
    """The server side of internal calls: only members of the deployment get through."""
    return MetadataCheckInterceptor(TOKEN_METADATA, token, "internal call without this deployment's token")


def ApiKeyInterceptor(api_keys: str | list[str]) -> MetadataCheckInterceptor:  # noqa: N802 - reads as a class
    """The router's public gRPC door with API keys: calls must carry `authorization: Bearer KEY`, KEY one of them."""
    keys = [api_keys] if isinstance(api_keys, str) else api_keys
    return MetadataCheckInterceptor("authorization", [f"Bearer {k}" for k in keys], "missing or wrong API key "
                                    "(metadata authorization: Bearer KEY)")


def matches(got: bytes, expected: list[bytes]) -> bool:
    """Whether `got` is one of `expected`, every one compared in constant time (how many there are
    and which one matched do not show in the time taken)."""
    found = False
    for e in expected:
        found |= hmac.compare_digest(got, e)
    return found


def load_api_keys(api_key: str | None, api_key_file: str | None) -> list[str]:
    """The API keys a router accepts: --api-key (or HYBRIDCACHE_API_KEY) and every line of
    --api-key-file (blank lines and lines starting with # left out). SecretError when the file
    cannot be read or holds no key."""
    keys = [api_key] if api_key else []
    if api_key_file:
        try:
            lines = Path(api_key_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise SecretError(f"cannot read the API key file {api_key_file}: {getattr(e, 'strerror', e)}") from None
        found = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not found:
            raise SecretError(f"the API key file {api_key_file} holds no key (one a line)")
        keys += found
    return keys


def tenant_of(api_key: str) -> str:
    """The name a key's requests have in the caches (--cache-isolation per-key): a hash of the key,
    which names it without disclosing it."""
    return hashlib.sha256(b"hybridcache-tenant|" + api_key.encode()).hexdigest()[:32]


def tenant_salt(tenant: str, salt) -> str:
    """The cache salt of a request of `tenant` (tenant_of) that asked for `salt` (vLLM's cache_salt,
    or None): its own key space within the tenant's."""
    if salt is not None and not isinstance(salt, str):
        from hybridcache.services.runtime.sampling import RequestError

        raise RequestError("cache_salt must be a string")
    return hashlib.sha256(f"{tenant}|{salt or ''}".encode()).hexdigest()
