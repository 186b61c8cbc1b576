"""Django Tasks decorators: the public path of :mod:`distlock.integrations.tasks`."""

from distlock.integrations.tasks import *  # noqa: F403
from distlock.integrations.tasks import __all__  # noqa: F401
