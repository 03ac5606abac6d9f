"""Every chore has a session: ``nox -s tests``, ``lint``, ``docs-build``, ``bench``, ``docs``, ``multinode``.

torch is installed first and pinned to the CPU build that the CI machine has
cached; the package metadata itself only asks for ``torch>=2.2``, so on GPU
machines ``pip install lamploop`` keeps the CUDA build already there.
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "lint", "docs-build"]

TORCH = os.environ.get("LAMPLOOP_TORCH", "torch==2.13.0")


def install(session: nox.Session, extras: str) -> None:
    session.install(TORCH)
    session.install("-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (multi-process tests included, GPU tests skip without CUDA).

    Every test not marked ``serial`` or ``soak``, on pytest-xdist workers side by side
    (``stress`` runs those; tests/conftest.py says which and why). With arguments, just
    ``pytest <arguments>``.
    """
    install(session, "test")
    if session.posargs:
        session.run("pytest", *session.posargs)
        return
    _compile(session)
    session.run("pytest", "-n", _workers(), "--dist", "loadfile", "-m", "not serial and not soak")


@nox.session
def stress(session: nox.Session) -> None:
    """The fault scenarios apart from the suite (CI runs them after ``tests``): the ``soak``
    modules on pytest-xdist workers, then the ``serial`` ones alone (tests/conftest.py)."""
    install(session, "test")
    _compile(session)
    session.run("pytest", "-n", _workers(), "--dist", "loadfile", "-m", "soak")
    session.run("pytest", "-p", "no:xdist", "-m", "serial")


def _compile(session: nox.Session) -> None:
    # Byte-compile once: the suite starts more than 140 Python processes (ranks, producers, the
    # CLI), and where PYTHONDONTWRITEBYTECODE is set (this CI machine) each would compile
    # lamploop and the test helpers again, about 0.5 s of CPU per process.
    session.run("python", "-m", "compileall", "-q", "-j", "0", "lamploop", "tests", "examples", silent=True)


def _workers() -> str:
    return os.environ.get("LAMPLOOP_TEST_WORKERS", "3")


@nox.session
def multinode(session: nox.Session) -> None:
    """Two hosts as network namespaces joined by a veth pair (needs root; skips with the reason otherwise)."""
    install(session, "test")
    session.run("pytest", "tests/distributed/test_multinode.py", "-v", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint and format check), mypy --strict and the import layers (import-linter) on the package."""
    install(session, "test,lint")
    session.run("ruff", "check", "lamploop", "tests", "benchmarks", "examples", "noxfile.py")
    session.run("ruff", "format", "--check", "lamploop")
    session.run("mypy")
    session.run("lint-imports")


@nox.session(name="docs-build")
def docs_build(session: nox.Session) -> None:
    """Build the site with warnings as errors (CI; ``docs`` also runs every example)."""
    install(session, "docs")
    session.run("mkdocs", "build", "--strict", "-d", "site", env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark; figures printed and written under bench-results/ as JSON."""
    install(session, "test,federated-bench")  # scikit-learn's digits; Flower for bench_federated.py
    quick = ["--quick"] if "quick" in session.posargs else []
    for script in sorted(os.listdir("benchmarks")):
        if script.startswith("bench_") and script.endswith(".py"):
            name = script.removeprefix("bench_").removesuffix(".py")
            session.run("python", f"benchmarks/{script}", "--json", f"bench-results/{name}.json", *quick)


@nox.session(name="bench-slowlink")
def bench_slowlink(session: nox.Session) -> None:
    """Sync strategies on a shaped veth link between two network namespaces (root; else loopback)."""
    install(session, "test")
    session.install("scikit-learn")
    quick = ["--quick"] if "quick" in session.posargs else []
    json_out = ["--json", "bench-results/strategies-slowlink.json"]
    session.run("python", "benchmarks/bench_strategies.py", "--slowlink", *json_out, *quick)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the site (mkdocs, warnings are errors) into site/; run every example in docs/ and README.md."""
    install(session, "docs,test")
    session.run("mkdocs", "build", "--strict", "-d", "site", env={"NO_MKDOCS_2_WARNING": "1"})
    session.run("pytest", "tests/test_docs.py", "-q", *session.posargs)
