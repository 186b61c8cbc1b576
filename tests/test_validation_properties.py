"""Property-based tests of the public API's bad and boundary inputs (DESIGN invariant 9).

tests/test_validation.py pins the cases someone thought of; here hypothesis generates
them: names of any length and Unicode shape, TTLs and timeouts of every numeric kind
(NaN, ±infinity, bool, huge, Decimal signalling NaN), tokens and owners of the wrong type.
The property is the same every time: a clear TypeError/ValueError that names the bad
argument, raised before any SQL, and the lock table exactly as it was. Good inputs at the
boundaries must round-trip exactly (a name is stored as given, a TTL gives that lease).

Example counts are modest so that the file stays well under 30 s per backend.
"""

from __future__ import annotations

import math
import unicodedata
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import DatabaseError
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from distlock import Lease, acquire, break_lock, lock, locked
from distlock.conf import conf
from distlock.models import Lock
from distlock.validation import MAX_NAME_LENGTH, MAX_TOKEN, MIN_TTL

pytestmark = pytest.mark.usefixtures("lock_db")

# One transactional database per test function; every example must leave it unchanged
# anyway, so sharing the fixture between examples is exactly the property under test.
# database=None: no .hypothesis/ folder in the work tree.
FEW = settings(
    max_examples=40, deadline=None, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
SOME = settings(FEW, max_examples=25)


def snapshot() -> list[dict[str, object]]:
    return list(Lock.objects.order_by("name").values())


def refused(call, *arguments, what: str, **options) -> BaseException:
    """Run ``call``; it must raise TypeError/ValueError mentioning ``what``, not a DB error."""
    with pytest.raises((TypeError, ValueError)) as caught:
        call(*arguments, **options)
    assert not isinstance(caught.value, DatabaseError), caught.value
    assert what in str(caught.value).lower(), f"unclear message: {caught.value!r}"
    return caught.value


# -- names ---------------------------------------------------------------------------

valid_text = st.text(
    alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"),
    min_size=1, max_size=MAX_NAME_LENGTH,
)
# A random stem repeated to a random length between one past the limit and 10,000.
too_long = st.tuples(
    st.text(min_size=1, max_size=40), st.integers(MAX_NAME_LENGTH + 1, 10_000)
).map(lambda parts: (parts[0] * (parts[1] // len(parts[0]) + 1))[: parts[1]])
with_nul = st.tuples(st.text(max_size=20), st.text(max_size=20)).map(
    lambda parts: parts[0] + "\x00" + parts[1]
)
with_surrogate = st.tuples(
    st.text(max_size=20), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
).map(lambda parts: parts[0] + parts[1])
non_str = st.one_of(
    st.none(), st.integers(), st.floats(allow_nan=True), st.binary(max_size=10),
    st.lists(st.text(max_size=3), max_size=2), st.booleans(),
)


@FEW
@given(name=st.one_of(st.just(""), too_long, with_nul, with_surrogate))
def test_bad_names_are_refused_and_nothing_changes(name):
    before = snapshot()
    refused(acquire, name, ttl=5, blocking=False, what="name")
    refused(lock, name, ttl=5, what="name")
    refused(break_lock, name, what="name")
    assert snapshot() == before


@SOME
@given(name=non_str)
def test_names_that_are_not_str_are_type_errors(name):
    before = snapshot()
    for call in (acquire, lock, break_lock):
        error = refused(call, name, what="name")
        assert isinstance(error, TypeError)
    assert snapshot() == before


@SOME
@given(name=valid_text)
def test_any_valid_name_is_stored_exactly_and_released(name):
    """Length 1…255, any plane, combining marks, RTL marks, emoji: the row has that name."""
    lease = acquire(name, ttl=30, blocking=False)
    assert lease is not None and lease.name == name
    assert Lock.objects.filter(name=name).values_list("owner", flat=True).get() == lease.owner
    assert lease.release() is True
    assert Lock.objects.get(name=name).owner == ""


@SOME
@given(word=st.text(
    alphabet=st.sampled_from("aeiouAEIOUéÉñÑåÅçÇ\u0301\u0308\u00fcöÖ "), min_size=1, max_size=12,
))
def test_unicode_forms_and_case_are_distinct_locks(word):
    """Names compare exactly on every backend: NFC and NFD spellings, and case, differ.

    MariaDB's default collation would fold these into one key; distlock's binary NO PAD
    collation must not.
    """
    forms = {
        word, unicodedata.normalize("NFC", word), unicodedata.normalize("NFD", word),
        word.upper(), word + " ",
    }
    forms = {form for form in forms if 0 < len(form) <= MAX_NAME_LENGTH}
    leases = [acquire(form, ttl=30, blocking=False) for form in sorted(forms)]
    try:
        assert all(lease is not None for lease in leases), "two spellings shared one lock"
        assert {lease.name for lease in leases} == forms
        assert Lock.objects.filter(name__in=forms).count() == len(forms)
    finally:
        for lease in leases:
            if lease is not None:
                lease.release()


# -- TTLs and timeouts -----------------------------------------------------------------

def max_ttl() -> float:
    return float(conf.MAX_TTL)


bad_number = st.one_of(
    st.floats(max_value=MIN_TTL, exclude_max=True),  # 0, negatives, -inf, tiny
    st.floats(min_value=24 * 3600.0, exclude_min=True),  # past DISTLOCK_MAX_TTL, +inf
    st.just(math.nan), st.just(-0.0),
    st.integers(max_value=0), st.integers(min_value=24 * 3600 + 1),
    st.sampled_from([Decimal("NaN"), Decimal("sNaN"), Decimal("Infinity"), Decimal("-1"),
                     Decimal("1E+400"), Decimal("0")]),
    st.timedeltas(max_value=timedelta(0)),
    st.timedeltas(min_value=timedelta(days=1, microseconds=1)),
)
bad_type = st.one_of(
    st.booleans(), st.text(max_size=5), st.complex_numbers(), st.lists(st.integers(), max_size=2),
    st.just(object()), st.just(b"30"),
)


@FEW
@given(ttl=st.one_of(bad_number, bad_type))
def test_bad_ttls_are_refused_everywhere_and_nothing_changes(ttl):
    holding = acquire("prop:ttl", ttl=60, blocking=False)
    assert holding is not None
    before = snapshot()
    try:
        refused(acquire, "prop:other", ttl=ttl, what="ttl")
        refused(lock, "prop:other", ttl=ttl, what="ttl")
        refused(locked, "prop:{x}", ttl=ttl, what="ttl")
        refused(holding.renew, ttl=ttl, what="ttl")
        assert not holding.lost, "a refused renew argument must not cost the lease"
        assert snapshot() == before
    finally:
        holding.release()


@SOME
@given(ttl=st.one_of(
    st.floats(min_value=MIN_TTL, max_value=24 * 3600.0),
    st.integers(min_value=1, max_value=24 * 3600),
    st.timedeltas(min_value=timedelta(milliseconds=1), max_value=timedelta(days=1)),
))
def test_every_ttl_in_range_gives_that_lease(ttl):
    assume(max_ttl() >= 24 * 3600.0)
    seconds = ttl.total_seconds() if isinstance(ttl, timedelta) else float(ttl)
    lease = acquire("prop:good-ttl", ttl=ttl, blocking=False)
    assert lease is not None
    try:
        row = Lock.objects.get(name="prop:good-ttl")
        # Never shorter than asked. MariaDB reads SYSDATE(6) once per use inside the
        # granting UPDATE, so its expiry can lie a few microseconds past acquired + ttl.
        excess = row.expires_us - row.acquired_us - round(seconds * 1e6)
        assert 0 <= excess < 1000, f"lease length off by {excess} µs"
        assert lease.remaining() <= seconds
    finally:
        held = lease.release()
    # A lease of a few milliseconds may have run out by now: release() then says so.
    assert held or seconds < 5


@SOME
@given(timeout=st.one_of(
    st.floats(max_value=0, exclude_max=True), st.just(math.nan), st.just(math.inf),
    st.integers(max_value=-1), st.timedeltas(max_value=timedelta(microseconds=-1)),
    st.sampled_from([Decimal("NaN"), Decimal("sNaN"), Decimal("-0.5")]), bad_type,
))
def test_bad_timeouts_are_refused(timeout):
    before = snapshot()
    refused(acquire, "prop:timeout", ttl=5, timeout=timeout, what="timeout")
    refused(lock, "prop:timeout", ttl=5, timeout=timeout, what="timeout")
    assert snapshot() == before


# -- tokens and owners ---------------------------------------------------------------

bad_token = st.one_of(
    st.booleans(), st.none(), st.floats(), st.text(max_size=5),
    st.integers(max_value=0), st.integers(min_value=MAX_TOKEN + 1),
    st.decimals(allow_nan=False, allow_infinity=False, places=0).filter(lambda d: d > 0),
    st.integers(1, 100).map(str), st.integers(1, 100).map(float),
)
bad_owner = st.one_of(
    st.none(), st.integers(), st.text(max_size=40).filter(
        lambda s: len(s) != 32 or any(c not in "0123456789abcdef" for c in s)
    ),
    st.just("A" * 32), st.just("g" * 32), st.binary(min_size=32, max_size=32),
)


@FEW
@given(token=bad_token)
def test_tokens_of_the_wrong_type_or_range_are_refused(token):
    holding = acquire("prop:token", ttl=60, blocking=False)
    assert holding is not None
    before = snapshot()
    try:
        assume(token is not None)  # break_lock(token=None) means "any token": valid
        refused(break_lock, "prop:token", token=token, what="token")
        refused(
            Lease, "prop:token", holding.owner, token, using=holding.using, ttl=5,
            what="token",
        )
        assert snapshot() == before
    finally:
        holding.release()


@SOME
@given(owner=bad_owner)
def test_forged_owner_shapes_are_refused(owner):
    holding = acquire("prop:owner", ttl=60, blocking=False)
    assert holding is not None
    before = snapshot()
    try:
        assume(owner is not None)
        refused(break_lock, "prop:owner", owner=owner, what="owner")
        refused(Lease, "prop:owner", owner, holding.token, using=holding.using, ttl=5,
                what="owner")
        assert snapshot() == before
    finally:
        holding.release()


@SOME
@given(token=st.integers(1, MAX_TOKEN), owner=st.uuids().map(lambda u: u.hex))
def test_well_formed_but_wrong_grants_change_nothing(token, owner):
    """A forged (owner, token) of the right shape: release/renew/break are refused no-ops."""
    holding = acquire("prop:forged", ttl=60, blocking=False)
    assert holding is not None
    assume((owner, token) != (holding.owner, holding.token))
    before = snapshot()
    try:
        forged = Lease("prop:forged", owner, token, using=holding.using, ttl=5)
        assert forged.release() is False
        forged = Lease("prop:forged", owner, token, using=holding.using, ttl=5)
        with pytest.raises(Exception, match="lost"):
            forged.renew()
        if owner != holding.owner:
            assert break_lock("prop:forged", owner=owner) is False
        if token != holding.token:
            assert break_lock("prop:forged", token=token) is False
        assert snapshot() == before
    finally:
        assert holding.release() is True
