"""distlock's modules form no import cycle, and each one imports alone.

A cycle makes the import order matter (a module sees a half-initialised one) and is
usually hidden by an import inside a function: those count here too. Only imports under
``if TYPE_CHECKING:`` are left out, since they never run.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

PACKAGE = Path(__file__).resolve().parent.parent / "distlock"


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if "migrations" in parts:
            continue  # loaded by Django's migration loader, never imported by distlock
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The distlock modules that ``name`` imports, wherever in the file the import is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if _is_type_checking(node.test):
                for statement in node.orelse:
                    self.visit(statement)
            else:
                self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            targets.update(alias.name for alias in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # "from distlock import db" imports distlock.db; "from distlock.db import run"
            # imports distlock.db. The package distlock itself only counts when a name
            # that is not a submodule is taken from it.
            names = [f"{base}.{alias.name}" for alias in node.names]
            submodules = [n for n in names if n in modules]
            targets.update(submodules)
            if len(submodules) < len(names) or base != "distlock":
                targets.add(base)

    Visitor().visit(ast.parse(path.read_text(), str(path)))
    return {target for target in targets if target in modules and target != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_module_list_sees_the_package():
    modules = _modules()
    assert {"distlock", "distlock.conf", "distlock.models", "distlock.core.locks"} <= set(modules)


def test_the_cycle_finder_finds_a_cycle():
    # The check below can only pass honestly if this one fails on a cycle.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_distlock():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycles = _cycles(graph)
    described = [
        "; ".join(f"{m} -> {sorted(graph[m] & set(group))}" for m in group) for group in cycles
    ]
    assert cycles == [], described


def test_settings_know_nothing_of_models():
    modules = _modules()
    assert _imports("distlock.conf", modules["distlock.conf"], modules) == set()
    assert _imports("distlock.constants", modules["distlock.constants"], modules) == set()


@pytest.mark.skipif(
    connection.vendor != "sqlite", reason="the same on every database: run once, on SQLite"
)
def test_each_module_imports_alone_in_a_fresh_interpreter():
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    failed = {}
    for name in _modules():
        # The package itself must import before Django is set up (settings import it);
        # the rest may need the app registry.
        setup = "import django; django.setup(); " if name != "distlock" else ""
        result = subprocess.run(
            [sys.executable, "-c", f"{setup}import importlib; importlib.import_module({name!r})"],
            cwd=PACKAGE.parent, env=env, capture_output=True, text=True, timeout=120,
        )
        if result.returncode != 0:
            failed[name] = result.stderr.strip().splitlines()[-1:]
    assert failed == {}


# The rooms of distlock, from the inside out (the README's "Layout"): a module may import
# from its own room and from rooms of its ring or further in, never from further out.
RINGS = [
    {"conf", "constants", "exceptions", "signals", "names", "times", "validation"},
    {"backends"},
    {"db"},
    {"models"},
    {"waiting"},
    {"core"},
    {"fencing"},
    {"admin", "integrations", "ops", "contrib", "checks", "testing", "leader", "periodic",
     "semaphores", "rwlocks"},
    {"management", "templatetags", "apps", "celery", "tasks", "distlock"},
]
# Arrows allowed outwards, each for a reason given here.
OUTWARDS = {
    # The public path distlock.models.FencedModel: a re-export, at the end of the module.
    ("distlock.models", "distlock.fencing"),
}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "distlock"


def _ring(room: str) -> int:
    return next(number for number, rooms in enumerate(RINGS) if room in rooms)


def test_every_room_has_a_ring():
    rooms = {_room(module) for module in _modules()}
    assert rooms == set().union(*RINGS), "a new room: give it a ring in RINGS"


def test_arrows_point_inward_only():
    modules = _modules()
    outward = sorted(
        (name, target)
        for name, path in modules.items() for target in _imports(name, path, modules)
        if _ring(_room(target)) > _ring(_room(name)) and (name, target) not in OUTWARDS
    )
    assert outward == []


def test_the_rooms_form_no_cycle():
    modules = _modules()
    rooms: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {_room(t) for t in _imports(name, path, modules)
                   if (name, t) not in OUTWARDS} - {_room(name)}
        rooms.setdefault(_room(name), set()).update(targets)
    assert _cycles(rooms) == []


# A site's settings with distlock and nothing else that patches Django: django_tasks_db
# (in the test settings and the demo's) imports django_stubs_ext, whose monkeypatch makes
# Django's generic classes subscriptable, so ``Lookup[bool]`` at run time passed every
# test and failed for users (0.2: the benchmark's quick mode caught it).
BARE_SITE = """
import django
from django.conf import settings
settings.configure(
    INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth",
                    "django.contrib.admin", "django.contrib.sessions",
                    "django.contrib.messages", "distlock"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
)
django.setup()
import sys
from django.db.models import Lookup
assert not hasattr(Lookup, "__class_getitem__"), "Django is patched: the check means nothing"
import importlib
failed = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
assert not failed, failed
"""


@pytest.mark.skipif(
    connection.vendor != "sqlite", reason="the same on every database: run once, on SQLite"
)
def test_every_module_imports_on_a_site_whose_django_nobody_patched():
    names = list(_modules())
    env = {key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"}
    result = subprocess.run(
        [sys.executable, "-c", BARE_SITE, *names],
        cwd=PACKAGE.parent, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr.strip().splitlines()[-3:]
