"""The install extras bring what the README's set-ups import.

``pip install "django-distlock[celery]"`` with the README's Redis broker: the worker died
with ``No module named 'packaging'`` (issue 27 item 12): kombu's Redis transport imports
``redis`` and ``packaging``, which plain ``celery`` does not install. Cheap checks, no
broker and no fresh virtualenv: the transport loads in this environment (a subprocess of
its interpreter, as a worker loads it), and it loads with only the distributions that
``pip install "django-distlock[celery]"`` installs importable (by the installed
packages' own metadata; every other installed package hidden).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent

# Loads the transport of a redis:// broker URL as a Celery worker does (kombu resolves
# the scheme, imports the module and makes its Transport, which checks for the redis
# client), without connecting. argv[1]: a JSON list of the distributions that may be
# imported (the others' modules are hidden, as if not installed), or null: all of them.
PROBE = """
import json, sys
from importlib import metadata
from importlib.abc import MetaPathFinder
from packaging.utils import canonicalize_name

allowed = json.loads(sys.argv[1])
if allowed is not None:
    hidden = {
        top for top, dists in metadata.packages_distributions().items()
        if not {canonicalize_name(dist) for dist in dists} & set(allowed)
    }
    for name in list(sys.modules):
        if name.partition(".")[0] in hidden:
            del sys.modules[name]  # packaging itself, imported just above

    class NotInstalled(MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in hidden:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
from kombu import Connection
print(type(Connection("redis://127.0.0.1:6379/0").transport).__module__)
"""


def _probe(allowed: set[str] | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(None if allowed is None else sorted(allowed))],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )


def _project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["project"]


def _brought_by(requirements: list[str]) -> set[str]:
    """The distributions pip installs for ``requirements`` (with their extras), by the
    metadata of the installed ones: a distribution not installed here ends its branch."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(text) for text in requirements]
    while todo:
        requirement = todo.pop()
        key = (canonicalize_name(requirement.name), frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            needs = metadata.requires(requirement.name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in needs:
            need = Requirement(text)
            extras = sorted(requirement.extras) or [""]
            if need.marker is None or any(need.marker.evaluate({"extra": e}) for e in extras):
                todo.append(need)
    return {name for name, _ in seen}


def _with_extra(extra: list[str]) -> set[str]:
    """What ``pip install "django-distlock[<extra>]"`` installs, given the extra's list."""
    return _brought_by(_project()["dependencies"] + extra) | {"django-distlock"}


def test_the_redis_transport_loads_in_this_environment():
    done = _probe(None)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "kombu.transport.redis"


def test_the_celery_extra_brings_what_the_redis_transport_imports():
    done = _probe(_with_extra(_project()["optional-dependencies"]["celery"]))
    assert done.returncode == 0, (
        'with only what pip install "django-distlock[celery]" installs, kombu\'s Redis '
        f"transport does not load:\n{done.stderr}"
    )
    assert done.stdout.strip() == "kombu.transport.redis"


def test_the_check_fails_with_the_extra_that_broke_the_worker():
    """The extra as it was (plain celery): the worker's very error. The check above can
    fail."""
    done = _probe(_with_extra(["celery>=5.3"]))
    assert done.returncode != 0
    assert "No module named 'packaging'" in done.stderr
