"""Project layout rules (docs/architecture.md): the packages list is complete, no shadowing, no test packages."""

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
MAPPING = {"kernels": "hybridcache.kernels", "services": "hybridcache.services", "operator": "hybridcache.operator",
           "models": "hybridcache.models"}


def test_every_package_dir_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    assert cfg["package-dir"] == {v: k for k, v in MAPPING.items()}
    expected = set()
    for src, pkg in MAPPING.items():
        base = ROOT / src
        expected.add(pkg)
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            if ".venv" in rel.parts or "__pycache__" in rel.parts:
                continue
            expected.add(".".join([pkg, *rel.parts]) if rel.parts else pkg)
    missing = sorted(expected - listed)
    assert not missing, f"package dirs missing from [tool.setuptools] packages: {missing}"
    stale = sorted(p for p in listed - expected if p != "hybridcache.operator")
    assert not stale, f"packages listed but without a directory: {stale}"


def test_operator_is_not_a_regular_package():
    assert not (ROOT / "operator" / "__init__.py").exists()
    import operator

    assert hasattr(operator, "itemgetter"), "the standard library's operator module is shadowed"


def test_no_init_under_tests():
    assert not list((ROOT / "tests").rglob("__init__.py"))


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in ci and "make test" in readme
    assert "make demo" in readme
