"""The repository's prose stays a user's guide: source comments carry no commit hashes or banners."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("kernels", "services", "operator")

# A git short or full hash: 7-40 lowercase hex digits with at least one letter and one digit,
# standing alone. Not a hex constant (0x...: the x is a letter before it), not part of a longer
# hex string (a sha256 digest is 64 digits), not a digest prefix ("sha256:" before it), not a UUID
# group (hyphens around it), not a decimal number, not an exponent literal like 1e10000.
COMMIT_HASH = re.compile(r"(?<![0-9A-Za-z_.:\-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z_\-])")
EXPONENT = re.compile(r"[0-9]+e[0-9]+")
BANNER = re.compile(r"^\s*#\s*(-{3,}|={3,}|\*{3,}|#{3,})")


def commit_hashes(text: str) -> list[str]:
    return [m.group() for m in COMMIT_HASH.finditer(text) if not EXPONENT.fullmatch(m.group())]


def source_files() -> list[Path]:
    files = [p for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    assert files, "no source files found"
    return files


@pytest.mark.parametrize(
    "text",
    ["at 531ce67 on one H200", "(3a94072, 637f190, c825280)", "before dc47e28.", "0b4d660" + "a" * 33],
)
def test_commit_hash_regex_finds_hashes(text):
    assert commit_hashes(text)


@pytest.mark.parametrize(
    "text",
    [
        "x = 0x1f2e3d4c",
        "sha256: " + "3f" * 32,
        "id 550e8400-e29b-41d4-a716-446655440000",
        "deadbeefcafe",
        "max_position_embeddings=1048576",
        "rope_theta: 10000000.0",
        "1e10000",
        "1.4426950408889634",
        "sha256:abcdef0123456789",
    ],
)
def test_commit_hash_regex_ignores_constants(text):
    assert commit_hashes(text) == []


def test_no_commit_hashes_in_source():
    found = [
        f"{p.relative_to(ROOT)}:{i}: {h}"
        for p in source_files()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        for h in commit_hashes(line)
    ]
    assert not found, "commit hashes belong in commit messages and results, not in source:\n" + "\n".join(found)


def test_no_section_banners_in_source():
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in source_files()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if BANNER.match(line)
    ]
    assert not found, "section banners (a class or module boundary says it instead):\n" + "\n".join(found)


README = ROOT / "README.md"
MAX_README_LINES = 200
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _gen_config_docs():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_is_at_most_200_lines():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; the rest belongs in docs/"


def test_readme_carries_no_commit_hashes():
    assert commit_hashes(README.read_text()) == []


def test_readme_first_link_stays_inside_the_repository():
    links = MARKDOWN_LINK.findall(README.read_text())
    assert links, "README.md links nothing"
    target = (ROOT / links[0].split("#")[0]).resolve()
    assert "://" not in links[0] and target.is_relative_to(ROOT), links[0]


@pytest.mark.parametrize("doc", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    missing = [
        link
        for link in MARKDOWN_LINK.findall(doc.read_text())
        if "://" not in link and not link.startswith(("#", "mailto:"))
        and not (doc.parent / link.split("#")[0]).exists()
    ]
    assert not missing, f"{doc.relative_to(ROOT)} links to missing files: {missing}"


def test_configuration_doc_matches_the_code():
    gen = _gen_config_docs()
    stale = gen.stale_blocks(gen.DOC.read_text(), gen.generated_blocks())
    assert not stale, f"docs/configuration.md is stale ({', '.join(stale)}): run python scripts/gen_config_docs.py"


def test_configuration_doc_lists_every_flag_of_every_subcommand():
    import argparse

    from hybridcache.services.cli import build_parser

    gen = _gen_config_docs()
    text = gen.DOC.read_text()
    for path, parser in gen._walk_parsers(build_parser(), ()):
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help") and not isinstance(action, argparse._SubParsersAction):
                    assert f"| `{flag}` | " in text and " ".join(path) in text, (path, flag)


def test_a_changed_flag_makes_the_doc_stale():
    from hybridcache.services.cli import build_parser

    gen = _gen_config_docs()
    text = gen.render(gen.DOC.read_text(), gen.generated_blocks())
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    sub.choices["generate"].add_argument("--new-flag", default=3, type=int, help="a flag the doc lacks")
    assert gen.stale_blocks(text, {"flags": gen.flags_table(parser)}) == ["flags"]
    assert "`--new-flag` | generate | int | `3` | a flag the doc lacks |" in gen.flags_table(parser)


def test_a_changed_crd_field_makes_the_doc_stale(tmp_path):
    import yaml

    gen = _gen_config_docs()
    text = gen.render(gen.DOC.read_text(), gen.generated_blocks())
    crd = yaml.safe_load(gen.CRD.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["engine"]["properties"]["seamWindow"]["default"] = 16
    changed = tmp_path / "crd.yaml"
    changed.write_text(yaml.safe_dump(crd))
    assert gen.stale_blocks(text, {"crd": gen.crd_table(changed)}) == ["crd"]
    assert "| `spec.engine.seamWindow` | integer | 0..4096 | `16` |" in gen.crd_table(changed)
