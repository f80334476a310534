"""The runtime config (services/config.py) generates the flags of every command that builds an
engine: one flag and one default per field of the sections the command takes, the same flag
everywhere, and `hybridcache up` forwards every field to the services that take it."""

import argparse
import dataclasses
import subprocess
import sys

import pytest
from hybridcache.services import launcher
from hybridcache.services.cli import build_parser
from hybridcache.services.config import (
    ENGINE_SECTIONS,
    SECTIONS,
    RuntimeConfig,
    config_args,
    config_fields,
    config_from_args,
    flag_name,
    format_value,
)
from hybridcache.services.config_docs import flag_table
from hybridcache.services.contract import ROLES
from hybridcache.services.runtime.evaluation import RUN_FIELDS

ENGINE_COMMANDS = ("generate", "demo", "eval", "serve", "up")
# the sections each command takes: the in-process ones no server or security settings
COMMAND_SECTIONS = {"generate": ENGINE_SECTIONS, "demo": tuple(SECTIONS), "eval": ENGINE_SECTIONS,
                    "serve": tuple(SECTIONS), "up": tuple(SECTIONS)}
# Alternatives the generic rule below cannot find (free-form strings, values valid only with another field's).
ALTERNATIVES = {"anchor_dtype": "float8_e4m3fn", "prefix_policy": "suffix_replay", "sdpa_backends": "flash,math",
                "transport_bandwidth": "cuda_ipc=80", "api_key": "k3y-of-the-test",
                "warmup_shape": "4x256+16", "gpu_memory_utilization": 0.5, "segment_separator": "<doc>",
                "max_queue_wait_s": 2.5}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[name] = sub
                out.update({f"{name} {k}": v for k, v in _subparsers(sub).items()})
    return out


def _command_parsers() -> dict[str, argparse.ArgumentParser]:
    return _subparsers(build_parser())


def _actions(parser: argparse.ArgumentParser, dest: str) -> list[argparse.Action]:
    return [a for a in parser._actions if a.dest == dest]


def _other(f: dataclasses.Field):
    """A valid value of the field other than its default."""
    if f.name in ALTERNATIVES:
        return ALTERNATIVES[f.name]
    if f.default is None:  # unset: any valid value is a change
        return f.metadata["type"](1000)
    if isinstance(f.default, bool):
        return not f.default
    if f.metadata.get("choices"):
        return [c for c in f.metadata["choices"] if c != f.default][-1]
    if isinstance(f.default, int):
        return f.default + 1
    raise AssertionError(f"add a non-default value of {f.name} to ALTERNATIVES")


def _changed() -> RuntimeConfig:
    """A config where every field differs from its default."""
    return RuntimeConfig(**{f.name: _other(f) for f in config_fields()})


def test_every_field_has_one_flag_and_one_default_in_every_engine_command():
    parsers = _command_parsers()
    flags = [flag_name(f) for f in config_fields()]
    assert len(set(flags)) == len(flags)
    for command in ENGINE_COMMANDS:
        p = parsers[command]
        for f in config_fields():
            actions = _actions(p, f.name)
            if f.metadata["section"] not in COMMAND_SECTIONS[command] or (command == "eval" and f.name in RUN_FIELDS):
                assert not actions, (command, f.name)
                continue
            assert len(actions) == 1, (command, f.name)
            assert actions[0].option_strings == [flag_name(f)], (command, f.name)
            assert actions[0].default == f.default, (command, f.name)
            # no hand-written flag of the command also sets the field
            others = [a for a in p._actions if flag_name(f) in a.option_strings and a is not actions[0]]
            assert not others, (command, f.name)
        required = {"serve": ["combine"], "generate": ["--model", "m", "--request", "r"]}.get(command, [])
        assert config_from_args(p.parse_args(required)) == RuntimeConfig(), command


def test_flags_agree_across_commands():
    parsers = _command_parsers()

    def spec(command, name):
        (a,) = _actions(parsers[command], name)
        return repr((a.option_strings, a.default, a.type, a.choices, a.help, a.metavar))

    for f in config_fields():
        seen = {spec(c, f.name) for c in ENGINE_COMMANDS
                if f.metadata["section"] in COMMAND_SECTIONS[c] and not (c == "eval" and f.name in RUN_FIELDS)}
        assert len(seen) == 1, (f.name, seen)


def test_each_field_is_in_one_section_and_commands_list_flags_by_section():
    for f in config_fields():
        assert f.metadata["section"] in SECTIONS, f.name
    help_text = _command_parsers()["generate"].format_help()
    for flag in ("--api-key", "--tls-certfile", "--secret-file", "--drain-grace-s"):
        assert flag not in help_text
    for name in ENGINE_SECTIONS:
        assert f"{name} ({SECTIONS[name]})" in help_text
    assert "security (" in _command_parsers()["up"].format_help()


def test_each_flag_parses_into_its_field():
    changed = _changed()
    for command, head in (("serve", ["scatter"]), ("up", [])):
        args = build_parser().parse_args([command, *head, *config_args(changed)])
        assert config_from_args(args) == changed, command
    engine_only = dataclasses.replace(RuntimeConfig(), **{f.name: getattr(changed, f.name)
                                                          for f in config_fields(sections=ENGINE_SECTIONS)})
    engine_flags = {flag_name(f) for f in config_fields(sections=ENGINE_SECTIONS)}
    pairs = config_args(engine_only)
    argv = [x for flag, value in zip(pairs[::2], pairs[1::2]) if flag in engine_flags for x in (flag, value)]
    args = build_parser().parse_args(["generate", "--model", "m", "--request", "r", *argv])
    assert config_from_args(args) == engine_only


class _FakeProc:
    """Stands in for a `hybridcache serve` child: prints its ready line, stops on a signal."""

    def __init__(self, cmd, env=None, stdout=None, **_):
        self.cmd, self.env = cmd, env or {}
        self.pid = 0
        self.returncode = None
        stdout.write(b'{"ready": "x"}\n')  # the child's log file

    def poll(self):
        return self.returncode

    def send_signal(self, _sig):
        self.returncode = 0

    def kill(self):
        self.returncode = -9

    def wait(self, timeout=None):
        return self.returncode


def test_up_forwards_every_field_to_the_roles_that_take_it(monkeypatch, tmp_path):
    for f in config_fields():
        assert f.metadata["roles"] and set(f.metadata["roles"]) <= set(ROLES), f.name
    spawned = []

    def popen(cmd, **kw):
        spawned.append(_FakeProc(cmd, **kw))
        return spawned[-1]

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    changed = _changed()
    up_args = build_parser().parse_args(["up", "--model", str(tmp_path), *config_args(changed)])
    with launcher.LocalCluster(tmp_path, scatter_workers=1, config=config_from_args(up_args)):
        pass
    roles = set()
    for proc in spawned:
        assert proc.cmd[1:4] == ["-m", "hybridcache.services.cli", "serve"]
        args = build_parser().parse_args(proc.cmd[3:])
        roles.add(args.role)
        # a field with an environment variable goes in the child's environment, never its arguments
        with monkeypatch.context() as m:
            for f in config_fields():
                if f.metadata["env"]:
                    assert str(getattr(changed, f.name)) not in proc.cmd, f.name
                    m.setenv(f.metadata["env"], proc.env.get(f.metadata["env"], ""))
            got = config_from_args(args)
        for f in config_fields():
            want = getattr(changed if args.role in f.metadata["roles"] else RuntimeConfig(), f.name)
            if f.name == "gpu_memory_utilization" and args.role in f.metadata["roles"]:
                want /= 2  # the combine and the scatter worker share GPU 0 (test_devices.py has the rule)
            assert getattr(got, f.name) == want, (args.role, f.name)
    assert roles == set(ROLES)


def test_no_abbreviations():
    """`--mode` must never be read as a prefix of `--model` (nor any flag as another's prefix)."""
    parsers = {"hybridcache": build_parser(), **_command_parsers()}
    assert all(p.allow_abbrev is False for p in parsers.values()), [n for n, p in parsers.items() if p.allow_abbrev]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--mod", "full"])
    assert build_parser().parse_args(["demo", "--mode", "full"]).mode == "full"


def test_bad_value_is_one_error_line(tmp_path):
    from hybridcache.services.cli import main

    for argv in (["demo", "--seam-window", "-1"], ["up", "--prefix-policy", "exact_replay", "--anchor-dtype", "fp4"],
                 ["demo", "--cuda-graphs", "maybe"]):
        proc = subprocess.run([sys.executable, "-m", "hybridcache.services.cli", *argv], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2, (argv, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert main(["generate", "--model", str(tmp_path), "--request", "-", "--max-segments", "0"]) == 2


def test_config_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import argparse\n"
            "from hybridcache.services.config import RuntimeConfig, add_config_flags, config_from_args\n"
            "from hybridcache.services.config_docs import flag_table\n"
            "p = argparse.ArgumentParser(); add_config_flags(p)\n"
            "c = config_from_args(p.parse_args(['--seam-window', '4']))\n"
            "assert c.seam_window == 4 and c.page_policy.name == 'exact_replay'\n"
            "print(len(flag_table().splitlines()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == 2 + len(config_fields())


def test_flag_table_lists_every_flag_with_its_default():
    rows = flag_table().splitlines()[2:]
    assert len(rows) == len(config_fields())
    for row, f in zip(rows, config_fields()):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == f"`{flag_name(f)}`"
        assert cells[1] == f"`{format_value(f.default)}`"


def test_runtime_reads_no_environment_switch():
    """Op dispatch, CUDA graphs and host staging come from the config: under kernels/ and
    services/runtime/ only the default model's location is read from the environment."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    reads = {}
    for p in [*(root / "kernels").rglob("*.py"), *(root / "services" / "runtime").rglob("*.py")]:
        found = re.findall(r"(?:os\.environ(?:\.get)?[\[(]|os\.getenv\()\s*\"([A-Z_0-9]+)\"", p.read_text())
        if found:
            reads[str(p.relative_to(root))] = sorted(set(found))
    assert reads == {"services/runtime/modelzoo.py": ["HYBRIDCACHE_MODEL"]}


def test_engine_takes_its_op_dispatch_and_graph_bound_from_the_config(qwen35_dir):
    from hybridcache.services.runtime import backends
    from hybridcache.services.runtime.engine import Engine

    eng = Engine.from_dir(qwen35_dir, config=RuntimeConfig(kernels="reference", sdpa_backends="math",
                                                           cuda_graph_shapes=3))
    assert eng.runner.dispatch == backends.OpDispatch("reference", "math")
    assert backends.current_dispatch() == backends.OpDispatch()  # the runner's, for its calls only
    other = Engine(eng.model, eng.tokenizer, RuntimeConfig())
    assert other.runner.dispatch == backends.OpDispatch() and eng.runner.dispatch.kernels == "reference"
