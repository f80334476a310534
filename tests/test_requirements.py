"""Declared requirements match what the code imports, the pins, the image and the generated gRPC code.

- every third-party module the shipped packages import belongs to a distribution pyproject.toml
  declares (operator/ may use the operator extra, the CUDA-only kernels the gpu extra); everything
  tests, benchmarks, tools and scripts import is declared too;
- constraints.txt pins every declared distribution inside its range, and the environment the
  tests run in holds exactly those versions;
- the Dockerfile installs the project with its gpu and operator extras under constraints.txt
  and names no distribution by hand;
- the grpcio and protobuf ranges admit the versions the checked-in services/protocol code was
  generated with and nothing older (nor another protobuf major, which that code refuses).
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import shlex
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# distributions of modules that are not installed in the CPU test environment (GPU only)
NOT_INSTALLED_HERE = {"fla": "fla-core"}
# files whose imports come from an extra other than their directory's
EXTRA_FILES = {"services/protocol/build.py": "test"}  # regenerates the gRPC code with grpcio-tools


def _requirements(items) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, items)}


CORE = _requirements(PYPROJECT["dependencies"])
EXTRAS = {name: _requirements(items) for name, items in PYPROJECT["optional-dependencies"].items()}
DECLARED = {**CORE, **{k: v for extra in EXTRAS.values() for k, v in extra.items()}}


def _local_modules() -> set[str]:
    """Names a module of the repository can be imported by (tests import their helpers by name)."""
    names = {"hybridcache"}
    for f in ROOT.rglob("*.py"):
        if ".venv" not in f.parts:
            names.add(f.stem)
            names.update(f.relative_to(ROOT).parts[:-1])
    return names


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def _third_party(dirs: list[str], skip: tuple[str, ...] = ()) -> dict[str, tuple[set[str], list[str]]]:
    """module -> (the distributions that provide it, the files importing it) for every
    third-party import under dirs (files in skip left out)."""
    local, stdlib = _local_modules(), set(sys.stdlib_module_names)
    owners = md.packages_distributions()
    found: dict[str, tuple[set[str], list[str]]] = {}
    for d in dirs:
        for f in sorted((ROOT / d).rglob("*.py")):
            rel = str(f.relative_to(ROOT))
            if rel in skip or ".venv" in f.parts:
                continue
            for mod in _imports(f) - stdlib - local:
                dists = owners.get(mod) or [NOT_INSTALLED_HERE.get(mod, f"<no installed distribution has {mod}>")]
                found.setdefault(mod, ({canonicalize_name(x) for x in dists}, []))[1].append(rel)
    return found


def _undeclared(found, allowed: dict[str, Requirement]) -> list[str]:
    """Modules none of whose distributions is allowed, each with its first importer."""
    return [f"{mod} ({'/'.join(sorted(dists))}, in {files[0]})"
            for mod, (dists, files) in sorted(found.items()) if not dists & set(allowed)]


def test_shipped_code_imports_only_declared_distributions():
    for d, allowed in (
        ("services", {**CORE, **EXTRAS["gpu"]}),
        ("kernels", {**CORE, **EXTRAS["gpu"]}),
        ("operator", {**CORE, **EXTRAS["operator"]}),
    ):
        missing = _undeclared(_third_party([d], skip=tuple(EXTRA_FILES)), allowed)
        assert not missing, f"{d}/ imports distributions pyproject.toml does not declare for it: {missing}"
    for rel, extra in EXTRA_FILES.items():
        found = {m: v for m, v in _third_party([str(Path(rel).parent)]).items() if rel in v[1]}
        missing = _undeclared(found, {**CORE, **EXTRAS[extra]})
        assert not missing, f"{rel} imports distributions neither core nor in the {extra} extra: {missing}"


def test_tests_benchmarks_tools_import_only_declared_distributions():
    missing = _undeclared(_third_party(["tests", "benchmarks", "tools", "scripts"]), DECLARED)
    assert not missing, f"undeclared distributions imported outside the packages: {missing}"


def _pins() -> dict[str, Version]:
    pins = {}
    for f in ("constraints.txt", "requirements/test.txt"):
        for line in (ROOT / f).read_text().splitlines():
            line = line.split("#")[0].strip()
            m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
            if m:
                pins[canonicalize_name(m.group(1))] = Version(m.group(2))
    return pins


def test_every_declared_distribution_is_pinned_inside_its_range():
    pins = _pins()
    unpinned = sorted(set(DECLARED) - set(pins))
    assert not unpinned, f"declared but pinned in neither constraints.txt nor requirements/test.txt: {unpinned}"
    outside = {d: (str(pins[d]), str(r.specifier)) for d, r in DECLARED.items() if pins[d] not in r.specifier}
    assert not outside, f"pins outside their pyproject.toml range: {outside}"
    # the CPU test environment installs every extra but gpu
    test_env = (ROOT / "requirements/test.txt").read_text()
    assert "-e .[test,operator]" in test_env and "gpu" not in re.findall(r"\[([^\]]*)\]", test_env)[0]


def test_installed_environment_is_the_pinned_one():
    wrong = {}
    for dist, version in _pins().items():
        try:
            installed = Version(md.version(dist))
        except md.PackageNotFoundError:
            continue  # the gpu extra's, or a part bootstrap.d installs only where it can
        if Version(installed.base_version) != version and installed != version:
            wrong[dist] = (str(installed), str(version))
    assert not wrong, f"installed versions differ from the pins (run `make setup`): {wrong}"


def _dockerfile_pip_installs() -> list[list[str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        if not line.strip().startswith("RUN"):
            continue
        for cmd in line.strip()[3:].split("&&"):
            words = shlex.split(cmd)
            if words[:2] == ["pip", "install"]:
                out.append(words[2:])
    return out


def test_dockerfile_installs_the_declared_requirements_only():
    installs = _dockerfile_pip_installs()
    assert installs, "the Dockerfile installs nothing with pip"
    for args in installs:
        assert args[:2] == ["-c", "constraints.txt"], args
        targets = [a for a in args[2:] if not a.startswith("-")]
        assert targets == [".[gpu,operator]"], f"the image installs {targets}: name distributions in pyproject.toml"
    assert {"gpu", "operator"} <= set(EXTRAS)
    assert {"fla-core", "triton"} <= set(EXTRAS["gpu"]) and "kopf" in EXTRAS["operator"]
    copied = " ".join(line for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("COPY"))
    assert "constraints.txt" in copied


def _lower_bound(req: Requirement) -> Version:
    (bound,) = [Version(s.version) for s in req.specifier if s.operator == ">="]
    return bound


def test_grpc_and_protobuf_ranges_match_the_generated_code():
    grpc_code = (ROOT / "services/protocol/hybridcache_pb2_grpc.py").read_text()
    grpc_generated = Version(re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", grpc_code).group(1))
    pb_code = (ROOT / "services/protocol/hybridcache_pb2.py").read_text()
    pb_generated = Version(re.search(r"# Protobuf Python Version: (\S+)", pb_code).group(1))
    for name, generated in (("grpcio", grpc_generated), ("grpcio-tools", grpc_generated), ("protobuf", pb_generated)):
        req = DECLARED[name]
        assert _lower_bound(req) == generated, f"{name} must start at {generated}, the generated code's version: {req}"
    # protobuf's generated code refuses another major version of the runtime
    assert Version(f"{pb_generated.major + 1}.0.0") not in CORE["protobuf"].specifier
    assert not list(CORE["protobuf"].specifier.filter([f"{pb_generated.major + 1}.0.0"]))


def test_docs_install_the_project_under_its_distribution_name():
    """`hybridcache` on the public index is another project: every `pip install` of this one in
    the README and docs/ names pyproject's distribution (or a path: `.`, a wheel)."""
    name = canonicalize_name(PYPROJECT["name"])
    assert name != "hybridcache"
    seen = 0
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in doc.read_text().splitlines():
            for m in re.finditer(r"pip install ([^`\n]*)", line):
                for word in shlex.split(m.group(1).split("#")[0], posix=True):
                    base = re.split(r"[\[ @=<>]", word, maxsplit=1)[0]
                    if base.startswith("hybridcache"):
                        seen += 1
                        assert canonicalize_name(base) == name, f"{doc.name}: {line.strip()}"
    assert seen, "no doc installs the project by its name"
