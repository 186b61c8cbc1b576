"""Task runners: Celery (``celery``) and Django's Tasks framework (``tasks``).

Both take the lock when a task runs, with a named contention policy (``policies``) and
the runner-independent part of the decorator (``taskfunc``). Users import them as
``distlock.celery`` and ``distlock.tasks``, the public paths.
"""
