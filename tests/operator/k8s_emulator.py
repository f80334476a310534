"""A strict Kubernetes API-server emulator over kmock, for running kopf and the operator offline.

kmock 0.8's KubernetesEmulator stores objects but assigns no resourceVersion, so kopf's finalizer
and status patches fail. This layer keeps kmock's HTTP server, request parsing and recording, API discovery, error
rendering and criteria (used to select injected faults), and replaces the object store with one
that behaves like an API server where the operator's tests depend on it:

- uid, resourceVersion (one global counter), generation (bumped on spec changes only),
  creationTimestamp and generateName are server-assigned;
- 409 AlreadyExists on a duplicate create, 409 Conflict on a stale resourceVersion (PATCH or
  PUT), PUT requires a resourceVersion, 422 Invalid from per-resource admission (the
  HybridCache CRD's defaults, schema and CEL rules), 404 for unknown objects and resources;
- the status subresource is separate: writes to the main resource ignore `.status`, writes to
  `/status` change only `.status`;
- the scale subresource (autoscaling/v1 Scale) for resources that declare one;
- deletion honours finalizers (deletionTimestamp first, removal when the last one goes);
- list returns the current resourceVersion; a watch started from it (or from any later one)
  replays exactly the events after it, then streams; a compacted resourceVersion yields 410.

Not emulated (tests in test_operator_emulator_limits.py state each one): garbage collection by
ownerReferences, defaulting and pruning of built-in kinds, server-side apply, strategic merge
(treated as JSON merge patch), field selectors, printer columns / Table output, /openapi,
admission webhooks, RBAC.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp.web
import attrs
import kmock

Key = tuple[str, str | None, str]  # (resource "group/version/plural", namespace, name)
STATUS_SUBRESOURCE = "status"
SCALE_SUBRESOURCE = "scale"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _res(resource: kmock.resource) -> str:
    return f"{resource.group}/{resource.version}/{resource.plural}"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def json_patch(target: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902 JSON patch (add, remove, replace, test); a failed op or test raises 422."""
    doc = copy.deepcopy(target)
    for op in ops:
        *parents, last = _pointer(op["path"])
        node = doc
        try:
            for part in parents:
                node = node[int(part)] if isinstance(node, list) else node[part]
            if op["op"] == "test":
                current = node[int(last)] if isinstance(node, list) else node[last]
                if current != op["value"]:
                    raise _error(422, "Invalid", f"test failed at {op['path']}")
            elif op["op"] == "remove":
                del node[int(last) if isinstance(node, list) else last]
            elif op["op"] in ("add", "replace"):
                value = copy.deepcopy(op["value"])
                if isinstance(node, list):
                    index = len(node) if last == "-" else int(last)
                    if op["op"] == "add":
                        node.insert(index, value)
                    else:
                        node[index] = value
                else:
                    if op["op"] == "replace" and last not in node:
                        raise KeyError(last)
                    node[last] = value
            else:
                raise _error(422, "Invalid", f"unsupported op {op['op']}")
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise _error(422, "Invalid", f"cannot {op['op']} {op['path']}: {exc}") from exc
    return doc


def _get_path(obj: dict[str, Any], path: str) -> Any:
    for part in path.strip(".").split("."):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def _set_path(obj: dict[str, Any], path: str, value: Any) -> None:
    parts = path.strip(".").split(".")
    for part in parts[:-1]:
        obj = obj.setdefault(part, {})
    obj[parts[-1]] = value


def _content(obj: dict[str, Any]) -> dict[str, Any]:
    """What the generation tracks: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


def _error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details={})


@attrs.define
class Fault:
    criteria: list[Any]
    remaining: int
    body: dict[str, Any]


@attrs.frozen
class ResourceType:
    kind: str
    namespaced: bool = True
    status: bool = False
    # (specReplicasPath, statusReplicasPath, labelSelectorPath) of a scale subresource
    scale: tuple[str, str, str] | None = None
    admit: Callable[[dict[str, Any]], dict[str, Any]] | None = None


@attrs.define(kw_only=True)
class StrictEmulator(kmock.KubernetesScaffold):
    _types: dict[str, ResourceType] = attrs.field(factory=dict, init=False)
    _store: dict[Key, dict[str, Any]] = attrs.field(factory=dict, init=False)
    _history: list[tuple[int, str, dict[str, Any]]] = attrs.field(factory=list, init=False)
    _rv: int = attrs.field(default=100, init=False)
    _compacted_to: int = attrs.field(default=0, init=False)
    _changed: asyncio.Condition | None = attrs.field(default=None, init=False)
    _closing: bool = attrs.field(default=False, init=False)

    _faults: list[Fault] = attrs.field(factory=list, init=False)
    _verbs: dict[Any, Callable[[kmock.Request], Any]] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._verbs.update({
            kmock.action.LIST: self._list,
            kmock.action.WATCH: self._watch,
            kmock.action.FETCH: self._fetch,
            kmock.action.CREATE: self._create,
            kmock.action.UPDATE: self._patch,
            kmock.action.DELETE: self._delete,
        })

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """Serve resource verbs directly. kmock's reaction matching walks the whole request
        history for every request (quadratic over a test), so only discovery goes through it."""
        verb = self._verbs.get(request.action) if request.action is not None else (
            self._replace if request.method == kmock.method.PUT else None)
        if request.resource is None or not request.resource.plural or verb is None:
            return await super()._handle(request)
        for fault in self._faults:
            if fault.remaining > 0 and all(c(request) for c in fault.criteria):
                fault.remaining -= 1
                return aiohttp.web.json_response(fault.body, status=fault.body["code"])
        result = verb(request)
        if request.action == kmock.action.WATCH:
            return await self._stream(request, result)
        return aiohttp.web.json_response(await result)

    async def _stream(self, request: kmock.Request, events: AsyncIterator[Any]) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        assert raw is not None
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)
        try:
            async for event in events:
                if event:
                    await response.write(json.dumps(event).encode() + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            return response
        await response.write_eof()
        return response

    # Set-up and introspection (call from the emulator's loop, or via EmulatorThread)

    def declare(self, resource: str, rtype: ResourceType) -> None:
        """Serve a resource type ("group/version/plural", "" group for core)."""
        self._types[resource] = rtype
        subresources = {s for s, on in ((STATUS_SUBRESOURCE, rtype.status), (SCALE_SUBRESOURCE, rtype.scale)) if on}
        self.resources[resource if resource.split("/")[0] else resource.lstrip("/")] = kmock.ResourceInfo(
            kind=rtype.kind,
            namespaced=rtype.namespaced,
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
            subresources=subresources,
        )

    def objects(self, resource: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(o) for (r, _, _), o in sorted(self._store.items()) if r == resource]

    async def close_watches(self) -> None:
        """End every open watch stream, as an API server does when it shuts down."""
        self._closing = True
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()

    def compact(self) -> None:
        """Forget the event history so far, as etcd compaction does; older watches get 410."""
        self._compacted_to = self._rv
        self._history.clear()

    def inject(self, status: int, *criteria: Any, times: int = 1, reason: str = "Injected") -> None:
        """Answer the next `times` requests matching all `criteria` (kmock criteria: action, method,
        resource, subresource, name...) with an error Status instead of serving them."""
        body = {
            "apiVersion": "v1", "kind": "Status", "status": "Failure", "metadata": {},
            "code": status, "reason": reason, "message": f"injected {status}",
        }
        self._faults.append(Fault([kmock.Criteria.guess(c) for c in criteria], times, body))

    # Internals

    def _type(self, request: kmock.Request) -> tuple[str, ResourceType]:
        assert request.resource is not None
        resource = _res(request.resource)
        if resource not in self._types:
            raise _error(404, "NotFound", f"the server could not find the requested resource {resource}")
        return resource, self._types[resource]

    def _key(self, request: kmock.Request, name: str | None = None) -> Key:
        resource, rtype = self._type(request)
        return (resource, request.namespace if rtype.namespaced else None, name or request.name or "")

    def _live(self, key: Key) -> dict[str, Any]:
        if key not in self._store:
            raise _error(404, "NotFound", f'{key[0]} "{key[2]}" not found')
        return self._store[key]

    async def _emit(self, resource: str, type_: str, obj: dict[str, Any]) -> None:
        self._history.append((int(obj["metadata"]["resourceVersion"]), resource, {
            "type": type_, "object": copy.deepcopy(obj),
        }))
        if self._changed is None:
            self._changed = asyncio.Condition()
        async with self._changed:
            self._changed.notify_all()

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _admit(self, rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        if rtype.admit is None:
            return obj
        try:
            return rtype.admit(obj)
        except Exception as exc:  # the admission function's message becomes the Status message
            raise _error(422, "Invalid", str(exc)) from exc

    async def _store_write(self, key: Key, rtype: ResourceType, new: dict[str, Any], event: str) -> dict[str, Any]:
        old = self._store.get(key)
        if old is not None and _content(old) != _content(new):
            new["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
        new["metadata"]["resourceVersion"] = self._next_rv()
        meta = new["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            del self._store[key]
            await self._emit(key[0], "DELETED", new)
            return new
        self._store[key] = new
        await self._emit(key[0], event, new)
        return copy.deepcopy(new)

    def _check_rv(self, body: dict[str, Any], live: dict[str, Any], required: bool) -> None:
        wanted = (body.get("metadata") or {}).get("resourceVersion")
        if wanted is None and required:
            raise _error(422, "Invalid", "metadata.resourceVersion: must be specified for an update")
        if wanted is not None and wanted != live["metadata"]["resourceVersion"]:
            raise _error(409, "Conflict", "the object has been modified; please apply your changes "
                                          "to the latest version and try again")

    # Verbs

    async def _list(self, request: kmock.Request) -> dict[str, Any]:
        resource, _ = self._type(request)
        items = [o for o in self.objects(resource) if self._selected(request, o)]
        return {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    def _selected(self, request: kmock.Request, obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        if request.namespace is not None and meta.get("namespace") != request.namespace:
            return False
        if request.name is not None and meta.get("name") != request.name:
            return False
        selector = request.params.get("labelSelector", "")
        labels = meta.get("labels") or {}
        for term in filter(None, selector.split(",")):
            key, _, value = term.partition("=")
            if labels.get(key) != value.lstrip("="):
                return False
        return True

    async def _watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        resource, _ = self._type(request)
        yield b""
        since = request.params.get("resourceVersion")
        if since in (None, "", "0"):
            position = len(self._history)
            for obj in self.objects(resource):
                if self._selected(request, obj):
                    yield {"type": "ADDED", "object": obj}
        else:
            if int(since) < self._compacted_to:
                yield {"type": "ERROR", "object": {
                    "apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 410,
                    "reason": "Expired", "message": f"too old resource version: {since}",
                }}
                return
            position = next((i for i, (rv, _, _) in enumerate(self._history) if rv > int(since)),
                            len(self._history))
        timeout = float(request.params.get("timeoutSeconds") or 3600)
        deadline = asyncio.get_running_loop().time() + timeout
        if self._changed is None:
            self._changed = asyncio.Condition()
        while True:
            while position < len(self._history):
                _, event_resource, event = self._history[position]
                position += 1
                if event_resource == resource and self._selected(request, event["object"]):
                    yield event
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0 or self._closing:
                return
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=min(remaining, 1.0))
                except asyncio.TimeoutError:
                    pass

    async def _fetch(self, request: kmock.Request) -> dict[str, Any]:
        key = self._key(request)
        _, rtype = self._type(request)
        live = self._live(key)
        if request.subresource == SCALE_SUBRESOURCE and rtype.scale:
            return self._scale_of(live, rtype)
        return copy.deepcopy(live)

    async def _create(self, request: kmock.Request) -> dict[str, Any]:
        resource, rtype = self._type(request)
        body = request.data
        if not isinstance(body, dict) or not isinstance(body.get("metadata"), dict):
            raise _error(400, "BadRequest", "the body must be an object with metadata")
        meta = body["metadata"]
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if not meta.get("name"):
            raise _error(422, "Invalid", "metadata.name: Required value")
        if rtype.namespaced:
            if meta.get("namespace", request.namespace) != request.namespace:
                raise _error(400, "BadRequest", "the namespace of the object does not match the URL")
            meta["namespace"] = request.namespace
        key = self._key(request, meta["name"])
        if key in self._store:
            raise _error(409, "AlreadyExists", f'{resource} "{meta["name"]}" already exists')
        obj = self._admit(rtype, copy.deepcopy(body))
        if rtype.status:
            obj.pop("status", None)
        obj["metadata"].update({
            "uid": str(uuid.uuid4()), "generation": 1, "creationTimestamp": _now(),
        })
        for field in ("deletionTimestamp", "resourceVersion"):
            obj["metadata"].pop(field, None)
        return await self._store_write(key, rtype, obj, "ADDED")

    async def _patch(self, request: kmock.Request) -> dict[str, Any]:
        _, rtype = self._type(request)
        key = self._key(request)
        live = self._live(key)
        content_type = request.headers.get("Content-Type", "").split(";")[0]
        scale = request.subresource == SCALE_SUBRESOURCE and rtype.scale
        current = self._scale_of(live, rtype) if scale else live
        if content_type == "application/json-patch+json" and isinstance(request.data, list):
            new = json_patch(current, request.data)
        elif content_type in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            patch = request.data if isinstance(request.data, dict) else {}
            self._check_rv(patch, live, required=False)
            new = merge_patch(current, patch)
        else:
            raise _error(415, "UnsupportedMediaType", f"the emulator does not serve {content_type} patches")
        if scale:
            return await self._write_scale(key, rtype, live, new)
        return await self._write(key, rtype, live, new, request.subresource)

    async def _replace(self, request: kmock.Request) -> dict[str, Any]:
        _, rtype = self._type(request)
        key = self._key(request)
        live = self._live(key)
        body = request.data if isinstance(request.data, dict) else {}
        self._check_rv(body, live, required=True)
        if request.subresource == SCALE_SUBRESOURCE and rtype.scale:
            return await self._write_scale(key, rtype, live, body)
        return await self._write(key, rtype, live, copy.deepcopy(body), request.subresource)

    async def _write(
        self, key: Key, rtype: ResourceType, live: dict[str, Any], new: dict[str, Any], subresource: str | None,
    ) -> dict[str, Any]:
        if subresource == STATUS_SUBRESOURCE:
            new = {**copy.deepcopy(live), "status": new.get("status", {})}
        elif rtype.status:
            new["status"] = copy.deepcopy(live.get("status", {}))
            if not new["status"]:
                new.pop("status")
        meta = new.setdefault("metadata", {})
        for field in ("uid", "creationTimestamp", "namespace", "name", "generation", "deletionTimestamp"):
            if field in live["metadata"]:
                meta[field] = live["metadata"][field]
            else:
                meta.pop(field, None)
        if subresource != STATUS_SUBRESOURCE:
            new = self._admit(rtype, new)
        return await self._store_write(key, rtype, new, "MODIFIED")

    def _scale_of(self, live: dict[str, Any], rtype: ResourceType) -> dict[str, Any]:
        assert rtype.scale is not None
        spec_path, status_path, selector_path = rtype.scale
        meta = live["metadata"]
        return {
            "apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")},
            "spec": {"replicas": _get_path(live, spec_path) or 0},
            "status": {"replicas": _get_path(live, status_path) or 0,
                       "selector": _get_path(live, selector_path) or ""},
        }

    async def _write_scale(
        self, key: Key, rtype: ResourceType, live: dict[str, Any], scale: dict[str, Any],
    ) -> dict[str, Any]:
        assert rtype.scale is not None
        new = copy.deepcopy(live)
        _set_path(new, rtype.scale[0], int((scale.get("spec") or {}).get("replicas", 0)))
        written = await self._write(key, rtype, live, new, None)
        return self._scale_of(written, rtype)

    async def _delete(self, request: kmock.Request) -> dict[str, Any]:
        _, rtype = self._type(request)
        key = self._key(request)
        live = self._live(key)
        if live["metadata"].get("finalizers"):
            if not live["metadata"].get("deletionTimestamp"):
                new = copy.deepcopy(live)
                new["metadata"]["deletionTimestamp"] = _now()
                return await self._store_write(key, rtype, new, "MODIFIED")
            return copy.deepcopy(live)
        del self._store[key]
        gone = copy.deepcopy(live)
        gone["metadata"]["resourceVersion"] = self._next_rv()
        await self._emit(key[0], "DELETED", gone)
        return {"apiVersion": "v1", "kind": "Status", "status": "Success", "details": {"name": key[2]}}


def standard_types(admit_hybridcache: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                   ) -> dict[str, ResourceType]:
    """The resource types the operator reads and writes, plus events (kopf posts them)."""
    scatter = (".spec.scatter.replicas", ".status.scatter.replicas", ".status.scatter.selector")
    workload_scale = (".spec.replicas", ".status.replicas", ".status.selector")
    return {
        "/v1/configmaps": ResourceType("ConfigMap"),
        "/v1/secrets": ResourceType("Secret"),
        "/v1/services": ResourceType("Service", status=True),
        "/v1/events": ResourceType("Event"),
        "/v1/namespaces": ResourceType("Namespace", namespaced=False, status=True),
        "apps/v1/deployments": ResourceType("Deployment", status=True, scale=workload_scale),
        "apps/v1/statefulsets": ResourceType("StatefulSet", status=True, scale=workload_scale),
        "policy/v1/poddisruptionbudgets": ResourceType("PodDisruptionBudget", status=True),
        "networking.k8s.io/v1/networkpolicies": ResourceType("NetworkPolicy"),
        "monitoring.coreos.com/v1/servicemonitors": ResourceType("ServiceMonitor"),
        "serving.hybridcache.io/v1alpha1/hybridcaches": ResourceType(
            "HybridCache", status=True, scale=scatter, admit=admit_hybridcache,
        ),
    }


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True)
