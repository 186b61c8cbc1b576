"""A real ASGI server (uvicorn) in a child process, on this test run's database.

The child runs with the tests' settings and the test database's name
(:func:`tests.support.processes.child_env`), so it serves tests/urls.py — which includes
the demo's bank URLs — and the test reads what the server wrote through its own ORM.
It listens on 127.0.0.1 on a free port; the test waits until the port accepts
connections (with a deadline), and the server is stopped by its PID at the end.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from tests.support.helpers import wait_until
from tests.support.processes import ROOT, child_env

APP = "demo_project.asgi:application"


def free_port() -> int:
    """A port nobody listens on now (the kernel's pick for port 0)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


@contextlib.contextmanager
def asgi_server(app: str = APP, timeout: float = 30.0) -> Iterator[str]:
    """Serve ``app`` with uvicorn; yield its base URL (``http://127.0.0.1:<port>``).

    Fails the test if the server exits early or does not listen within ``timeout`` s,
    and if it does not stop cleanly on SIGTERM at the end.
    """
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port),
             "--lifespan", "off", "--no-access-log", "--log-level", "info"],
            cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True,
        )

        def output() -> str:
            log.seek(0)
            return log.read()[-3000:]

        try:
            wait_until(lambda: proc.poll() is not None or accepts(port), timeout,
                       f"uvicorn listening on port {port}")
            if proc.poll() is not None:
                raise AssertionError(f"uvicorn exited ({proc.returncode}):\n{output()}")
            yield f"http://127.0.0.1:{port}"
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
                    raise AssertionError(f"uvicorn ignored SIGTERM:\n{output()}") from None
        # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught (exit -15 or
        # 0 by version); a crash while serving, or no graceful shutdown, fails the test.
        said = output()
        assert proc.returncode in (0, -signal.SIGTERM), f"exit {proc.returncode}:\n{said}"
        assert "Finished server process" in said, said
