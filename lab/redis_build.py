"""A redis-server that runs under libfaketime, for the lab's clock scenario.

Debian's redis-server aborts under libfaketime: its static jemalloc calls
``clock_gettime`` while libfaketime is still starting. So the lab builds the *same
upstream version* as the installed package from Debian's own source (the orig tarball
that ``apt-get source`` fetches, its SHA-256 checked against the ``.dsc``) with
``MALLOC=libc``, once, into ``~/.cache/distlock-lab/`` (22 s of compiling on two cores). apt
reads a private list of ``deb-src`` lines there: nothing of the system's apt set-up changes.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from lab.servers import Unavailable

SUITES = (
    "http://deb.debian.org/debian bookworm main",
    "http://deb.debian.org/debian-security bookworm-security main",
)
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "distlock-lab"


def installed_version() -> str:
    """The Debian version of the installed redis-server package (e.g. 5:7.0.15-1~deb12u10)."""
    try:
        answer = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "redis-server"],
                                capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as error:
        raise Unavailable("the Debian package redis-server is not installed") from error
    return answer.stdout.strip()


def upstream(version: str) -> str:
    """Upstream part of a Debian version: 5:7.0.15-1~deb12u10 → 7.0.15."""
    return version.split(":", 1)[-1].rsplit("-", 1)[0]


def faketime_redis() -> str:
    """Path of the libc-malloc redis-server, built first if the cache has none."""
    version = installed_version()
    target = cache_dir() / f"redis-{upstream(version)}-libc" / "redis-server"
    if target.exists():
        return str(target)
    cache_dir().mkdir(parents=True, exist_ok=True)
    with (cache_dir() / "build.lock").open("w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # another lab run may be building it right now
        if not target.exists():
            build(version, target)
    return str(target)


def fetch_source(version: str, into: Path) -> Path:
    """Debian's source package of ``version`` into ``into``; returns the checked orig tarball."""
    apt = cache_dir() / "apt"
    (apt / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (apt / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
    sources = apt / "sources.list"
    sources.write_text("".join(f"deb-src [signed-by={KEYRING}] {line}\n" for line in SUITES))
    options = [
        "-o", f"Dir::Etc::SourceList={sources}", "-o", "Dir::Etc::SourceParts=/nonexistent",
        "-o", f"Dir::State::Lists={apt / 'lists'}", "-o", f"Dir::Cache={apt / 'cache'}",
        "-o", "APT::Sandbox::User=root", "-qq",
    ]
    if shutil.which("apt-get") is None:
        raise Unavailable("apt-get not found: the lab builds redis-server from Debian's source")
    subprocess.run(["apt-get", *options, "update"], check=True, capture_output=True)
    subprocess.run(["apt-get", *options, "source", "--download-only", f"redis={version}"],
                   check=True, capture_output=True, cwd=into)
    dsc = next(into.glob("redis_*.dsc"))
    orig = next(into.glob("redis_*.orig.tar.*"))
    expected = re.search(rf"^ ([0-9a-f]{{64}}) \d+ {re.escape(orig.name)}$",
                         dsc.read_text(), re.MULTILINE)
    digest = hashlib.sha256(orig.read_bytes()).hexdigest()
    if expected is None or expected.group(1) != digest:
        raise RuntimeError(f"{orig.name}: SHA-256 {digest} is not the one in {dsc.name}")
    return orig


def build(version: str, target: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="distlock-redis-build-") as work:
        folder = Path(work)
        orig = fetch_source(version, folder)
        with tarfile.open(orig) as archive:
            archive.extractall(folder, filter="data")
        tree = folder / f"redis-{upstream(version)}"
        jobs = str(min(os.cpu_count() or 1, 4))
        result = subprocess.run(
            ["make", f"-j{jobs}", "MALLOC=libc", "BUILD_TLS=no", "USE_SYSTEMD=no"],
            cwd=tree, capture_output=True, text=True,
        )
        if result.returncode != 0:
            raise RuntimeError(f"building redis-server failed:\n{result.stdout[-3000:]}"
                               f"{result.stderr[-3000:]}")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        shutil.copy2(tree / "src" / "redis-server", partial)
        partial.rename(target)  # whole or absent: a killed build leaves no half binary
