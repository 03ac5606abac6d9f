"""Every ```python block in README.md and docs/ runs, and so do the docstring examples.

A block that cannot run here (it needs torchrun, Slurm, several machines, or elides
arguments with ``...``) is marked ``python test="skip"`` after the opening fence, the
pytest-examples convention; such a block is still compiled, so it stays valid Python.
docs/hooks.py removes the marker from the rendered site.

Every page under docs/ must be in mkdocs.yml's nav, so none is left out of the site.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest
from pytest_examples import CodeExample, EvalExample, find_examples

import lamploop

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

EXAMPLES = list(find_examples(ROOT / "README.md", DOCS))


def _skipped(example: CodeExample) -> bool:
    return example.prefix_settings().get("test") == "skip"


@pytest.mark.parametrize("example", [e for e in EXAMPLES if not _skipped(e)], ids=str)
def test_documentation_example_runs(example: CodeExample, eval_example: EvalExample) -> None:
    eval_example.run(example)


@pytest.mark.parametrize("example", [e for e in EXAMPLES if _skipped(e)], ids=str)
def test_documentation_example_that_cannot_run_here_compiles(example: CodeExample) -> None:
    compile(example.source, str(example), "exec")


def _pages() -> set[str]:
    return {page.relative_to(DOCS).as_posix() for page in DOCS.rglob("*.md")}


def test_every_page_is_in_the_site_nav() -> None:
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = config[config.index("\nnav:") : config.index("\nmarkdown_extensions:")]
    listed = set(re.findall(r"^\s*- (?:[^\n]*?: )?([\w./-]+\.md)\s*$", nav, flags=re.MULTILINE))
    assert _pages() - listed == set(), "pages missing from mkdocs.yml's nav"
    assert listed - _pages() == set(), "nav entries without a page"


def test_every_page_with_python_blocks_is_collected() -> None:
    with_blocks = {page for page in _pages() if re.search(r"^ *```py", (DOCS / page).read_text(), re.M)}
    collected = {
        example.path.relative_to(DOCS).as_posix() for example in EXAMPLES if example.path.is_relative_to(DOCS)
    }
    assert with_blocks <= collected


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(lamploop.__path__, "lamploop."))


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
