"""The operator UI: the admin of locks and lock events, and the pages they link to.

``locks`` and ``events`` are the model admins (registered on import, which Django's admin
autodiscovery does), ``locks`` with its parts ``lock_page``, ``breaking`` and ``filters``
(``bases`` types them); ``views`` the overview and timeline pages; ``overview`` and
``timeline`` the queries and the history they show, ``timeline_svg`` its drawing;
``display``, ``search`` and ``paging`` what the lists share; ``task_keys`` the read-only
list of enqueue_once's keys.
"""

from distlock.admin.events import LockEventAdmin
from distlock.admin.locks import LockAdmin
from distlock.admin.task_keys import TaskKeyAdmin

__all__ = ["LockAdmin", "LockEventAdmin", "TaskKeyAdmin"]
