"""Django for a lab worker process: distlock and the lab's Cell table on the lab database."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit


def database(url: str) -> dict[str, str]:
    """Django's DATABASES entry for a ``postgresql://user@host:port/name`` URL."""
    parts = urlsplit(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parts.path.lstrip("/"),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "127.0.0.1",
        "PORT": str(parts.port or 5432),
    }


def setup(url: str) -> None:
    import django
    from django.conf import settings

    settings.configure(
        DATABASES={"default": database(url)}, USE_TZ=True, SECRET_KEY="lab", DEBUG=False,
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "distlock",
                        "lab"],
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
    )
    django.setup()


def create_database(url: str) -> None:
    """The lab database on the server of ``url``, created if missing."""
    import psycopg

    entry = database(url)
    admin = {"host": entry["HOST"], "port": entry["PORT"], "user": entry["USER"],
             "dbname": "postgres"}
    if entry["PASSWORD"]:
        admin["password"] = entry["PASSWORD"]
    with psycopg.connect(**admin, autocommit=True) as conn:  # type: ignore[arg-type]
        found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                             (entry["NAME"],)).fetchone()
        if not found:
            conn.execute(f'CREATE DATABASE "{entry["NAME"]}"')


def migrate() -> None:
    """distlock's migrations and the lab's table (an app without migrations)."""
    from django.core.management import call_command

    call_command("migrate", run_syncdb=True, verbosity=0)
