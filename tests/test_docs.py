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
