"""Every ```python block in README.md and docs/ runs, and so do the docstring examples."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest
from pytest_examples import CodeExample, EvalExample, find_examples

import lamploop

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("example", list(find_examples(ROOT / "README.md", ROOT / "docs")), ids=str)
def test_documentation_example_runs(example: CodeExample, eval_example: EvalExample) -> None:
    eval_example.run(example)


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(lamploop.__path__, "lamploop."))


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
