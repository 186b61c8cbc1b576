"""Celery task decorators: the public path of :mod:`distlock.integrations.celery`."""

from distlock.integrations.celery import *  # noqa: F403
from distlock.integrations.celery import __all__  # noqa: F401
