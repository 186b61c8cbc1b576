"""The lock core: getting, holding and giving back a lease.

``locks`` (acquire, lock, locked, break, purge) and ``async_locks`` (their async twins)
are the two doors; ``grants`` holds the steps both share; ``leases`` the Lease a grant
becomes; ``status`` the state of a lock by the database clock; ``uncommitted`` and
``shielding`` the two seams with the caller (its open transaction, its cancellation);
``batches`` the purge's short transactions. Waiting between tries is
:mod:`distlock.waiting`'s; the SQL is :mod:`distlock.backends`'.
"""
