"""The layout is a contract, not prose: every module is in a layer and in docs/architecture.md's map.

The layers themselves (who may import whom) are checked by import-linter in ``nox -s lint``
(``[tool.importlinter]`` in pyproject.toml); these tests make sure that contract and the
map cover the whole package, so that a new module cannot slip past both.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - CI runs 3.11
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lamploop"


def _top_level() -> set[str]:
    """Every module and subpackage directly under lamploop/ (``__init__`` aside)."""
    names = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    names |= {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return names


def _layered() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    names = set()
    for layer in contract["layers"]:
        for module in re.split(r"[|:]", layer):
            name = module.strip()
            assert name.startswith("lamploop."), name
            names.add(name.removeprefix("lamploop."))
    return names


def test_every_module_is_in_one_layer_of_the_import_contract() -> None:
    top, layered = _top_level(), _layered()
    assert top - layered == set(), "modules outside the layers: add them to [tool.importlinter]"
    assert layered - top == set(), "layers naming modules that do not exist"


def test_every_module_is_in_the_architecture_map() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = sorted(name for name in _top_level() if not re.search(rf"`{name}(/|\.py)?`", text))
    assert missing == [], f"docs/architecture.md does not name {missing}"


def test_the_version_matches_the_changelog() -> None:
    """A released version is the CHANGELOG's newest release; a .dev version is the Unreleased one's goal."""
    import lamploop

    text = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", text, flags=re.MULTILINE)
    version = lamploop.__version__
    if ".dev" in version:
        goal = version.split(".dev")[0]
        assert re.search(rf"^## \[Unreleased\]\n\nTowards {re.escape(goal)}\.$", text, flags=re.MULTILINE)
        assert goal not in releases
    else:
        assert releases[0] == version
    sections: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("## "):
            current = sections.setdefault(line, [])
        elif line.startswith("### "):
            current.append(line)
    for release, kinds in sections.items():
        assert len(kinds) == len(set(kinds)), f"{release}: a kind of change is listed twice: {kinds}"
