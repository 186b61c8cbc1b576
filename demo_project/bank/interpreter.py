"""How to name this interpreter in a command line the demo prints for people to copy."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path


def python_command(cwd: Path | None = None) -> str:
    """This Python (the venv's, when the demo runs in one), as a shell word.

    ``python manage.py runserver`` in a fresh shell runs whatever ``python`` is on the
    PATH, often one without Django: the interpreter running the demo has it. Relative to
    ``cwd`` (default: the current directory) when it lies below it — ``.venv/bin/python``
    — else its absolute path.
    """
    executable = Path(sys.executable)
    try:
        shown = executable.relative_to(Path.cwd() if cwd is None else cwd)
    except ValueError:
        shown = executable
    return shlex.quote(str(shown))
