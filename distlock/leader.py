"""Leader election: one process of many runs a loop, and its term is a fencing token.

A leader is the holder of one lock, kept by auto-renewal; its **term is the lease's
token**, so terms only grow and two leaders of one election are never both unexpired by
the database clock (the lock's own promise). What the lock cannot do is stop a leader
that paused (a GC stall, SIGSTOP, a cut network) and woke after its successor was
elected: Kubernetes' client-go says its election gives no fencing for that reason. Here
the leader's writes carry its term — ``obj.save(fence=term.lease)`` — and the database
refuses them once a later term exists.

Two forms:

- :func:`run_as_leader` campaigns, calls ``on_elected(term)``, runs ``loop(term)`` while
  it leads, calls ``on_lost(term)`` when the lease is lost, and campaigns again; it
  returns when the loop returns (after stepping down) or ``stop`` is set.
- :func:`elect` campaigns once and returns the :class:`Term` (None on timeout): the
  caller runs its own loop and calls :meth:`Term.resign`. :func:`aelect` is its async
  twin (renewal in an asyncio task, as ``alock(auto_renew=True)``).

A loop cannot be stopped from outside in Python, so it asks: :meth:`Term.sleep` waits
between rounds and returns False as soon as the term is over by the local clock (the
lease's conservative ``remaining()``) or a renewal failed; a loop that ignores it keeps
running, and only its fenced writes are refused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from distlock.constants import LEADER_MARK
from distlock.core.async_locks import aacquire
from distlock.core.leases import Lease
from distlock.core.locks import acquire
from distlock.exceptions import StaleToken
from distlock.validation import Seconds

#: How long one campaign round of run_as_leader waits for the lock before it looks at
#: ``stop`` again (seconds).
CAMPAIGN_ROUND = 5.0


class Term:
    """One leadership: ``token`` (the term number, the lease's fencing token) and ``lease``.

    ``active`` is True while the lease is held by the local clock and no renewal failed;
    it becomes False, for good, when either ends or the term is resigned.
    """

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.name = lease.name
        self.token = lease.token
        self._over = threading.Event()
        self._resigned = False

    def __repr__(self) -> str:
        return f"<Term {self.name!r} #{self.token}{'' if self.active else ' (over)'}>"

    @property
    def active(self) -> bool:
        if self._over.is_set():
            return False
        if self.lost:
            self._over.set()
            return False
        return True

    @property
    def lost(self) -> bool:
        """True once the lease is lost: a renewal failed, a fenced write was refused, or
        its time ran out by the local clock (a resignation is not a loss)."""
        return not self._resigned and (self.lease.lost or self.lease.remaining() <= 0)

    def sleep(self, seconds: float) -> bool:
        """Wait up to ``seconds`` (less when the lease ends first, or a renewal fails);
        True if still the leader afterwards. ``while term.sleep(5): work()``."""
        if not self.active:
            return False
        self._over.wait(min(max(0.0, seconds), self.lease.remaining()))
        return self.active

    def resign(self) -> bool:
        """Step down: release the lease (True if it was still held)."""
        self._resigned = True
        self._over.set()
        return self.lease.release()

    async def aresign(self) -> bool:
        """:meth:`resign` for async code."""
        self._resigned = True
        self._over.set()
        return await self.lease.arelease()

    def _lost(self, lease: Lease, exc: BaseException | str) -> None:
        self._over.set()


def leader_holder(holder: str) -> str:
    """The holder text of an election's lock: the caller's, after :data:`LEADER_MARK`, which
    is how the admin and the ``distlock_leader_term`` gauge find elections. (A holder that
    is not a str is left as it is, for acquire's own check to refuse.)"""
    if not isinstance(holder, str):
        return holder
    return f"{LEADER_MARK} {holder}".rstrip()


def elect(
    name: str, *, ttl: Seconds = 30, timeout: Seconds | None = None,
    using: str | None = None, holder: str = "",
) -> Term | None:
    """Campaign for ``name`` until elected (or ``timeout`` seconds, None: for ever) and
    return the :class:`Term`, renewed in a helper thread until :meth:`Term.resign`;
    None if not elected in time. Raises what :func:`~distlock.acquire` raises."""
    holder_lease = acquire(
        name, ttl=ttl, timeout=timeout, using=using, holder=leader_holder(holder),
        min_hold=None, max_hold=None, lock_delay=None,  # a leader leads until it loses
    )
    if holder_lease is None:
        return None
    term = Term(holder_lease)
    holder_lease.start_auto_renew(on_lost=term._lost)
    return term


async def aelect(
    name: str, *, ttl: Seconds = 30, timeout: Seconds | None = None,
    using: str | None = None, holder: str = "",
) -> Term | None:
    """:func:`elect` for async code: the renewal is an asyncio task of the running loop,
    so the term lasts while the loop runs; end it with ``await term.aresign()``."""
    holder_lease = await aacquire(
        name, ttl=ttl, timeout=timeout, using=using, holder=leader_holder(holder),
        min_hold=None, max_hold=None, lock_delay=None,  # a leader leads until it loses
    )
    if holder_lease is None:
        return None
    term = Term(holder_lease)
    holder_lease.start_auto_arenew(on_lost=term._lost)
    return term


def run_as_leader(
    name: str, loop: Callable[[Term], object], *, ttl: Seconds = 30,
    using: str | None = None, holder: str = "",
    on_elected: Callable[[Term], object] | None = None,
    on_lost: Callable[[Term], object] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Campaign for ``name`` and run ``loop(term)`` whenever elected.

    When ``loop`` returns while its term is still active, the leader resigns and this
    returns: the work is done. When the term ends under it (a renewal failed, the lease
    ran out by the local clock, a fenced write under it was refused — that StaleToken
    ends the term and is not raised), ``on_lost(term)`` is called
    once the loop has returned and the campaign starts again. An exception from ``loop``
    resigns and propagates. ``stop`` (a threading.Event) ends the campaign between
    rounds: set it, and a loop that watches ``term.sleep`` returns within its sleep.
    """
    stop = stop or threading.Event()
    while not stop.is_set():
        term = elect(name, ttl=ttl, timeout=CAMPAIGN_ROUND, using=using, holder=holder)
        if term is None:
            continue
        if stop.is_set():
            term.resign()
            return
        if on_elected is not None:
            on_elected(term)
        watcher = threading.Thread(
            target=_end_on_stop, args=(term, stop), name=f"distlock-leader-{name[:40]}",
            daemon=True,
        )
        watcher.start()
        try:
            loop(term)
        except StaleToken:
            if not term.lease.lost:  # another lease's write: the loop's own error
                raise
            # This term's write refused: a later term exists. Lost, not an error.
        finally:
            lost = term.lost
            term.resign()
        if stop.is_set() or not lost:
            return
        if on_lost is not None:
            on_lost(term)


def _end_on_stop(term: Term, stop: threading.Event) -> None:
    """Ends the term's sleeps when ``stop`` is set, so run_as_leader returns promptly."""
    while not term._over.wait(0.1):
        if stop.is_set():
            term._over.set()
            return
