"""Operating distlock: the audit trail of lock events (``audit``) and the step after a
database failover (``failover``). The management commands (``distlock/management``) and
the Prometheus metrics (``distlock.contrib.prometheus``) live where Django and users
expect them.
"""
