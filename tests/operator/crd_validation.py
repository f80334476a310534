"""What an API server does with a custom resource before storing it, as far as it can be done
offline: structural defaulting, OpenAPI schema validation (jsonschema) and the
x-kubernetes-validations CEL rules (cel-python). Used by the CRD tests and by the emulator.

Not done here (a real API server does): pruning of unknown fields, CEL cost limits, transition
rules (oldSelf), format checks beyond jsonschema's, quantity parsing of int-or-string fields.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "manifests" / "crd" / "hybridcache.yaml"


@dataclass(frozen=True)
class Invalid(Exception):
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


@cache
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def schema(version: str = "v1alpha1") -> dict[str, Any]:
    for v in crd()["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(version)


def apply_defaults(value: Any, node: dict[str, Any]) -> Any:
    """Structural defaulting, top-down: a defaulted {} is then defaulted inside."""
    if isinstance(value, dict):
        for key, sub in (node.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(value[key], sub)
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            for key in list(value):
                if key not in (node.get("properties") or {}):
                    value[key] = apply_defaults(value[key], extra)
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        value = [apply_defaults(v, node["items"]) for v in value]
    return value


_cel = celpy.Environment()


@cache
def _program(rule: str) -> Any:
    return _cel.program(_cel.compile(rule))


def check_cel(value: Any, node: dict[str, Any], path: str = "") -> None:
    for rule in node.get("x-kubernetes-validations") or ():
        result = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})
        if isinstance(result, Exception) or not bool(result):
            raise Invalid(path + rule.get("fieldPath", ""), rule.get("message", rule["rule"]))
    if isinstance(value, dict):
        for key, sub in (node.get("properties") or {}).items():
            if key in value:
                check_cel(value[key], sub, f"{path}.{key}")
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            for key, sub_value in value.items():
                if key not in (node.get("properties") or {}):
                    check_cel(sub_value, extra, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            check_cel(item, node["items"], f"{path}[{i}]")


def admit(obj: dict[str, Any], version: str = "v1alpha1") -> dict[str, Any]:
    """Default and validate a HybridCache object; returns the defaulted copy or raises Invalid."""
    root = schema(version)
    obj = apply_defaults(copy.deepcopy(obj), root)
    errors = sorted(jsonschema.Draft4Validator(root).iter_errors(obj), key=lambda e: list(e.path))
    if errors:
        first = errors[0]
        raise Invalid("." + ".".join(str(p) for p in first.path), first.message)
    check_cel(obj, root)
    return obj
