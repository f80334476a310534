"""Rewrite the generated tables of docs/configuration.md from the code.

    python scripts/gen_config_docs.py           # rewrite the tables in place
    python scripts/gen_config_docs.py --check   # exit 1 (and say which table) when they are stale

Three tables, each between a `<!-- BEGIN GENERATED: name -->` and an `<!-- END GENERATED: name -->`
line; the prose around them is kept as written:
- `flags`: every option of every `hybridcache` subcommand, read from the real parser
  (`services/cli.py: build_parser`, walked through its subparsers), so the table follows the
  parser however its flags are declared;
- `crd`: every field of the HybridCache CRD's spec (`manifests/crd/`, the single source);
- `env`: every `HYBRIDCACHE_*` environment variable named in kernels/, services/ or operator/.
tests/test_docs.py fails while the file differs from what this script writes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
CRD = ROOT / "manifests" / "crd" / "hybridcache.yaml"
SOURCE_DIRS = ("kernels", "services", "operator")
ENV_NAME = re.compile(r"\bHYBRIDCACHE_[A-Z0-9_]*[A-Z0-9]\b")


def _cell(text) -> str:
    """A Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text) -> str:
    return f"`{text}`" if text not in ("", None) else ""


def _value(v) -> str:
    """A default as a user would write it: JSON for containers and booleans, strings bare."""
    if isinstance(v, str):
        return v if v else '""'
    if isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v) and v:
        return ",".join(v)
    return json.dumps(v)


def _walk_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...]):
    """(command path, parser) for every parser that has options of its own, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk_parsers(sub, path + (name,))


def _flag_value(action: argparse.Action) -> str:
    """What the option takes: nothing for a switch, its choices, or a type name."""
    if action.nargs == 0:
        return "switch"
    if action.choices is not None:
        return " \\| ".join(f"`{c}`" for c in action.choices)
    if action.metavar:
        return _code(action.metavar)
    kind = getattr(action.type, "__name__", None) if action.type is not None else "str"
    kind = {"_positive": "int > 0"}.get(kind, kind)
    return kind if kind and not kind.startswith("_") else "value"


def _flag_default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.nargs == 0 or action.default is None or action.default is argparse.SUPPRESS:
        return ""
    return _code(_value(action.default))


def flag_rows(parser: argparse.ArgumentParser) -> list[tuple[str, str, str, str, list[str]]]:
    """One row per (option, value, default, help) with the subcommands that share it, in the order
    the options first appear."""
    rows: dict[tuple[str, str, str, str], list[str]] = {}
    for path, p in _walk_parsers(parser, ()):
        if not path:
            continue
        command = " ".join(path)
        for action in p._actions:
            if isinstance(action, (argparse._SubParsersAction, argparse._HelpAction)):
                continue
            name = ", ".join(action.option_strings) or f"{action.dest} (positional)"
            key = (name, _flag_value(action), _flag_default(action), _cell(action.help or ""))
            rows.setdefault(key, []).append(command)
    return [(*key, commands) for key, commands in rows.items()]


def flags_table(parser: argparse.ArgumentParser | None = None) -> str:
    if parser is None:
        from hybridcache.services.cli import build_parser

        parser = build_parser()
    lines = ["| flag | commands | takes | default | what it does |", "|---|---|---|---|---|"]
    for name, value, default, help_, commands in flag_rows(parser):
        lines.append(f"| `{name}` | {', '.join(commands)} | {value} | {default} | {help_} |")
    return "\n".join(lines)


def _schema_rows(schema: dict, path: str):
    """(field path, its schema, whether its parent requires it) for every property below `schema`,
    depth first; an array's items as `path[]`."""
    required = set(schema.get("required") or [])
    for name, sub in (schema.get("properties") or {}).items():
        here = f"{path}.{name}" if path else name
        yield here, sub, name in required
        yield from _schema_rows(sub, here)
        if sub.get("type") == "array" and isinstance(sub.get("items"), dict):
            yield from _schema_rows(sub["items"], here + "[]")


def _field_type(schema: dict) -> str:
    kind = schema.get("type")
    if kind is None and "anyOf" in schema:
        kind = " or ".join(s.get("type", "?") for s in schema["anyOf"])
    if kind == "array":
        item = (schema.get("items") or {}).get("type", "")
        kind = f"array of {item}" if item else "array"
    if kind == "object" and "additionalProperties" in schema:
        kind = "map"
    return kind or ""


def _field_bounds(schema: dict) -> str:
    parts = []
    if "enum" in schema:
        parts.append(" \\| ".join(f"`{v}`" if v != "" else '`""`' for v in schema["enum"]))
    if "minimum" in schema or "maximum" in schema:
        parts.append(f"{schema.get('minimum', '')}..{schema.get('maximum', '')}")
    if "minLength" in schema or "maxLength" in schema:
        parts.append(f"length {schema.get('minLength', 0)}..{schema.get('maxLength', '')}")
    if "pattern" in schema:
        parts.append(f"pattern `{schema['pattern']}`")
    return "; ".join(parts)


def crd_rows(crd: dict) -> list[tuple[str, str, str, str, str, str]]:
    """(field, type, allowed values, default, required, description) for each field of spec."""
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rows = []
    for path, schema, required in _schema_rows(spec, "spec"):
        default = schema.get("default")
        default = "" if default is None else _code(_value(default))
        desc = _cell(schema.get("description", ""))
        rows.append((path, _field_type(schema), _field_bounds(schema), default, "yes" if required else "", desc))
    return rows


def crd_rules(crd: dict) -> list[tuple[str, str, str]]:
    """(field, CEL rule, message) of every x-kubernetes-validations entry under spec."""
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    found = [("spec", spec)] + [(path, schema) for path, schema, _ in _schema_rows(spec, "spec")]
    return [(path, r["rule"], r.get("message", "")) for path, schema in found
            for r in schema.get("x-kubernetes-validations") or []]


def crd_table(crd_path: Path = CRD) -> str:
    crd = yaml.safe_load(crd_path.read_text())
    lines = ["| field | type | allowed | default | required | what it does |", "|---|---|---|---|---|---|"]
    for path, kind, bounds, default, required, desc in crd_rows(crd):
        lines.append(f"| `{path}` | {kind} | {bounds} | {default} | {required} | {desc} |")
    lines += ["", "Validation rules (CEL, checked by the API server):", "",
              "| on | rule | message |", "|---|---|---|"]
    for path, rule, message in crd_rules(crd):
        lines.append(f"| `{path}` | `{_cell(rule)}` | {_cell(message)} |")
    return "\n".join(lines)


def env_names(root: Path = ROOT) -> dict[str, list[str]]:
    """Every HYBRIDCACHE_* name in the source trees -> the files that name it."""
    names: dict[str, set[str]] = {}
    for d in SOURCE_DIRS:
        for p in sorted((root / d).rglob("*.py")):
            for name in ENV_NAME.findall(p.read_text()):
                names.setdefault(name, set()).add(str(p.relative_to(root)))
    return {n: sorted(files) for n, files in sorted(names.items())}


# What each variable does, for the table; a name the code gains without an entry here gets an
# empty cell (the table still lists it, so the docs test asks for a regeneration).
ENV_HELP = {
    "HYBRIDCACHE_FAULT_EXIT_AFTER_ENTRIES": "tests only: a scatter worker exits after streaming this many entries",
    "HYBRIDCACHE_MODEL": "the default model's directory (else the one shipped as hybridcache/models/default)",
    "HYBRIDCACHE_OPERATOR_METRICS_PORT": "operator: port of its Prometheus metrics (0 = off)",
    "HYBRIDCACHE_RETRY_DELAY": "operator: seconds before a failed reconcile is retried (default 10)",
    "HYBRIDCACHE_SHM_DIR": "directory of the shared-memory transport (default /dev/shm)",
    "HYBRIDCACHE_TIMER_INTERVAL": "operator: seconds between autoscaling timer runs (default 15)",
    "HYBRIDCACHE_INSTANCE": "set by the operator in every pod: the HybridCache's name",
    "HYBRIDCACHE_MODEL_ARCH": "set by the operator: spec.model.arch",
    "HYBRIDCACHE_MODEL_DIR": "set by the operator: the model directory inside the pod",
    "HYBRIDCACHE_DTYPE": "set by the operator: spec.engine.dtype",
    "HYBRIDCACHE_SEAM_WINDOW": "set by the operator: spec.engine.seamWindow",
    "HYBRIDCACHE_PREFIX_POLICY": "set by the operator: spec.engine.prefixPolicy",
    "HYBRIDCACHE_ETCD_ENDPOINTS": "set by the operator: spec.etcd.endpoints, comma-separated",
}


def env_table(root: Path = ROOT) -> str:
    lines = ["| variable | what it does | named in |", "|---|---|---|"]
    for name, files in env_names(root).items():
        where = ", ".join(f"`{f}`" for f in files)
        lines.append(f"| `{name}` | {ENV_HELP.get(name, '')} | {where} |")
    return "\n".join(lines)


def generated_blocks() -> dict[str, str]:
    return {"flags": flags_table(), "crd": crd_table(), "env": env_table()}


def render(text: str, blocks: dict[str, str]) -> str:
    """`text` with each generated block's body replaced; every block must be present once."""
    for name, body in blocks.items():
        pattern = re.compile(
            rf"(<!-- BEGIN GENERATED: {name} -->\n).*?(<!-- END GENERATED: {name} -->)", re.DOTALL
        )
        if len(pattern.findall(text)) != 1:
            raise SystemExit(f"{DOC.relative_to(ROOT)}: needs exactly one generated block named {name!r}")
        text = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), text)
    return text


def stale_blocks(text: str, blocks: dict[str, str]) -> list[str]:
    """Names of the blocks whose body in `text` differs from `blocks`."""
    return [name for name in blocks if render(text, {name: blocks[name]}) != text]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/configuration.md is stale")
    args = ap.parse_args(argv)
    text = DOC.read_text()
    blocks = generated_blocks()
    if args.check:
        stale = stale_blocks(text, blocks)
        if stale:
            print(f"{DOC.relative_to(ROOT)} is stale ({', '.join(stale)}): run python scripts/gen_config_docs.py")
            return 1
        return 0
    DOC.write_text(render(text, blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
