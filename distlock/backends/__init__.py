"""Every vendor-specific statement and fact of distlock, one module per database vendor.

``backend_for(connection)`` picks the backend by ``connection.vendor``: the module
``distlock.backends.<vendor>`` and its ``BACKEND`` class (a subclass of
:class:`~distlock.backends.base.Backend`), imported at first use and kept for the process.
So a new database backend is one new module here (plus its test settings); nothing else
in distlock names a vendor.
"""

from __future__ import annotations

import importlib
import threading

from django.db.backends.base.base import BaseDatabaseWrapper

from distlock.backends.base import Backend

_found: dict[str, Backend | None] = {}
_loading = threading.Lock()


def backend_named(vendor: str) -> Backend | None:
    """The backend for ``connection.vendor`` == ``vendor``; None if distlock has none."""
    try:
        return _found[vendor]
    except KeyError:
        pass
    with _loading:
        if vendor not in _found:
            _found[vendor] = _load(vendor)
    return _found[vendor]


def _load(vendor: str) -> Backend | None:
    if not vendor.isidentifier() or vendor == "base":
        return None
    module_name = f"{__name__}.{vendor}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise  # the module exists but something it needs does not
        return None
    backend = getattr(module, "BACKEND", None)
    if not (isinstance(backend, type) and issubclass(backend, Backend)):
        return None
    return backend() if backend.vendor == vendor else None


def supported(connection: BaseDatabaseWrapper) -> Backend | None:
    """The backend of ``connection``'s database, or None where distlock has none (the
    system checks and migrations report or skip such a database instead of failing)."""
    return backend_named(connection.vendor)


def backend_for(connection: BaseDatabaseWrapper) -> Backend:
    """The backend of ``connection``'s database. Raises NotImplementedError if distlock
    does not support it.

    One dict lookup once loaded: the lock operations call this on every run.
    """
    backend = _found.get(connection.vendor) or backend_named(connection.vendor)
    if backend is None:
        raise NotImplementedError(
            f"distlock does not support the {connection.vendor!r} database backend"
        )
    return backend
