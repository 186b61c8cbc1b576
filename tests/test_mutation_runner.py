"""scripts/mutation, the mutation check: it must fail loudly, and classify what it ran.

A mutant whose original text is missing (the code moved) or ambiguous stops the check
before anything runs; a mutant that breaks the syntax is invalid, not "killed"; and one run
on SQLite shows a killed and a surviving mutant told apart, with the exit status that fails
CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.machinery import SourceFileLoader
from pathlib import Path
from types import ModuleType

import pytest
from django.db import connection

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "mutation"


@pytest.fixture(scope="module")
def runner() -> ModuleType:
    loader = SourceFileLoader("distlock_mutation_runner", str(SCRIPT))
    module = ModuleType(loader.name)
    module.__file__ = str(SCRIPT)
    # Registered while it runs: dataclasses look their module up in sys.modules.
    sys.modules[loader.name] = module
    try:
        loader.exec_module(module)
    finally:
        del sys.modules[loader.name]
    return module


def mutant(original: str, replacement: str = "x = 2\n", file: str = "pkg/code.py") -> str:
    return f"""
[[mutant]]
id = "one"
promise = "a promise"
file = "{file}"
original = '''
{original}'''
replacement = '''
{replacement}'''
backends = ["sqlite"]
tests = ["tests/test_code.py"]
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A tiny repository layout: one module and one test file."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "code.py").write_text("x = 1\ny = 1\ny = 1\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_code.py").write_text("")
    return tmp_path


@pytest.mark.parametrize(
    ("original", "replacement", "message"),
    [
        ("x = 3\n", "x = 2\n", "the original text does not occur"),
        ("y = 1\n", "y = 2\n", "the original text occurs 2 times"),
        ("x = 1\n", "x = (\n", "invalid mutant"),
        ("x = 1\n", "x = 1\n", "the replacement equals the original"),
    ],
)
def test_a_mutant_that_cannot_apply_exactly_once_stops_the_check(
    runner, project, original, replacement, message
):
    path = project / "mutants.toml"
    path.write_text(mutant(original, replacement))
    with pytest.raises(runner.MutantFileError, match=message):
        runner.load(path, root=project)


def test_a_mutant_file_with_unknown_keys_or_missing_tests_is_refused(runner, project):
    path = project / "mutants.toml"
    path.write_text(mutant("x = 1\n") + 'colour = "red"\n')
    with pytest.raises(runner.MutantFileError, match="unknown keys"):
        runner.load(path, root=project)
    path.write_text(mutant("x = 1\n").replace("tests/test_code.py", "tests/test_gone.py"))
    with pytest.raises(runner.MutantFileError, match="no test file"):
        runner.load(path, root=project)


def test_the_projects_mutants_all_apply(runner):
    mutants = runner.load(runner.MUTANTS)
    assert len({m.id for m in mutants}) == len(mutants) >= 17


@pytest.mark.parametrize(
    ("code", "output", "result"),
    [
        (0, "3 passed in 1.0s", "survived"),
        (1, "FAILED tests/test_a.py::test_b - AssertionError: assert 1 == 2", "killed"),
        (1, "FAILED tests/test_a.py::test_b[a b] - AssertionError\n"
            "ERROR tests/test_a.py::test_b[a b] - AssertionError: teardown", "killed"),
        (1, "ERROR tests/test_a.py::test_b - django.db.utils.ProgrammingError: syntax error "
            "at or near \"FORR\"", "error"),
        (1, "FAILED tests/test_a.py::test_b - ImportError: cannot import name 'x'", "error"),
        (2, "ERROR tests/test_a.py - SyntaxError: invalid syntax", "error"),
        (4, "the postgresql database is configured but unreachable", "error"),
        (5, "no tests ran", "error"),
    ],
)
def test_outcomes_are_classified(runner, code, output, result):
    assert runner.classify(code, output)[0] == result


def test_a_killed_and_a_surviving_mutant_on_sqlite(runner, tmp_path):
    """End to end: scratch copies, baselines, a killed, a surviving mutant and one whose
    baseline fails."""
    if connection.vendor != "sqlite":
        pytest.skip(f"runs on the SQLite pass only (it starts SQLite runs; this: "
                    f"{connection.vendor})")
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the runner copies the files git lists")
    test = "tests/test_validation.py::test_bad_ttls[0-ValueError]"
    (tmp_path / "mutants.toml").write_text(f"""
[[mutant]]
id = "ttl-minimum-dropped"
promise = "a ttl below MIN_TTL is refused"
file = "distlock/validation.py"
original = "    if seconds < MIN_TTL:"
replacement = "    if seconds < 0:"
backends = ["sqlite"]
tests = ["{test}"]

[[mutant]]
id = "docstring-only"
promise = "none: a docstring changes, so the tests must pass (a survivor)"
file = "distlock/validation.py"
original = "Return the lease length in seconds"
replacement = "Return the length of the lease in seconds"
backends = ["sqlite"]
tests = ["{test}"]

[[mutant]]
id = "on-a-failing-baseline"
promise = "none: its test does not exist, so its baseline fails and so does the check"
file = "distlock/validation.py"
original = "    if seconds < MIN_TTL:"
replacement = "    if seconds < 0:"
backends = ["sqlite"]
tests = ["tests/test_validation.py::test_no_such_test"]
""")
    env = {**os.environ, "DISTLOCK_TEST_DB_SUFFIX": os.environ.get(
        "DISTLOCK_TEST_DB_SUFFIX", "") + "_runner"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--mutants", str(tmp_path / "mutants.toml")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()
            if line.startswith(("ttl-minimum-dropped ", "docstring-only ", "on-a-failing"))}
    assert rows["ttl-minimum-dropped"][1:3] == ["sqlite", "killed"]
    assert rows["ttl-minimum-dropped"][4] == test
    assert rows["docstring-only"][1:3] == ["sqlite", "survived"]
    assert rows["on-a-failing-baseline"][1:3] == ["sqlite", "error"]
    assert "1 killed, 1 survived, 1 errors" in done.stdout
    assert "baseline failing on sqlite: tests/test_validation.py::test_no_such_test" in done.stdout
    # The working tree is never changed.
    assert "if seconds < MIN_TTL:" in (ROOT / "distlock" / "validation.py").read_text()


def test_a_moved_original_fails_the_command_before_any_run(tmp_path):
    (tmp_path / "mutants.toml").write_text(mutant(
        "    if seconds < MIN_TTL_MOVED:\n", file="distlock/validation.py"
    ).replace("tests/test_code.py", "tests/test_validation.py"))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--mutants", str(tmp_path / "mutants.toml")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2
    assert "the original text does not occur" in done.stderr
    assert "mutation check:" in done.stderr and "killed" not in done.stdout
