"""The one helper through which the operator writes to the API server.

`apply` makes a child equal to what a builder returned: create it when absent, replace it
(PUT with the live resourceVersion, so a concurrent writer yields 409 and a retry) when it
differs, and write nothing when the live object already contains the desired one. Responses
stay plain dicts; the `kubernetes` client is used only for configuration, auth and transport.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import kubernetes
from hybridcache.services import contract

JSON = "application/json"
PLURALS = {
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "Service": "services",
    "Deployment": "deployments",
    "StatefulSet": "statefulsets",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "NetworkPolicy": "networkpolicies",
    "ServiceMonitor": "servicemonitors",
    contract.KIND: "hybridcaches",
}
# Server-allocated Service fields that a replace must carry over from the live object.
SERVICE_ALLOCATED = ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy")


@dataclass
class ApiError(Exception):
    status: int
    reason: str
    message: str

    def __str__(self) -> str:
        return f"{self.status} {self.reason}: {self.message}"


def object_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{PLURALS[kind]}"
    return f"{path}/{name}" if name else path


def is_subset(desired: Any, live: Any) -> bool:
    """True when every field of `desired` has the same value in `live` (server defaults ignored)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(is_subset(d, v) for d, v in zip(desired, live))
        )
    return desired == live or str(desired) == str(live)


class Kube:
    def __init__(self, api_client: kubernetes.client.ApiClient):
        self.client = api_client

    def request(self, method: str, path: str, body: Any = None, content_type: str = JSON) -> Any:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        _, url, headers, body, _ = self.client.param_serialize(
            method, path, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        response = self.client.call_api(method, url, header_params=headers, body=body)
        data = response.read()
        payload = json.loads(data) if data else {}
        if not 200 <= response.status < 300:
            reason = payload.get("reason", response.reason or "")
            raise ApiError(response.status, reason, payload.get("message", ""))
        return payload

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", object_path(api_version, kind, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return self.request("POST", object_path(obj["apiVersion"], obj["kind"], meta["namespace"]), obj)

    def replace(self, obj: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
        body = json.loads(json.dumps(obj))
        body["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
        if obj["kind"] == "Service":
            for key in SERVICE_ALLOCATED:
                if key in live.get("spec", {}):
                    body["spec"].setdefault(key, live["spec"][key])
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        return self.request("PUT", path, body)

    def create_if_absent(self, obj: dict[str, Any]) -> str:
        """Create `obj` unless an object of its name exists (left as it is: the API server's 409);
        returns 'created' or 'unchanged'. For objects whose content is made once (a generated
        secret); it never reads the live object, so the operator needs only `create` on them."""
        try:
            self.create(obj)
        except ApiError as exc:
            if exc.status != 409:
                raise
            return "unchanged"
        return "created"

    def apply(self, obj: dict[str, Any]) -> str:
        """Make the live object contain `obj`; returns 'created', 'replaced' or 'unchanged'.

        Raises ApiError for anything but a create race (409 on create is followed by a replace)
        or a delete race (404 on replace is followed by a create); the caller's retry handles it.
        """
        meta = obj["metadata"]
        live = self.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        if live is None:
            try:
                self.create(obj)
                return "created"
            except ApiError as exc:
                if exc.status != 409:
                    raise
                live = self.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
                if live is None:
                    raise
        if is_subset(obj, live):
            return "unchanged"
        try:
            self.replace(obj, live)
        except ApiError as exc:
            if exc.status != 404:
                raise
            self.create(obj)
            return "created"
        return "replaced"
