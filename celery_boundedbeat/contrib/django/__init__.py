"""Django integration: admin pages over the schedules and the run history.

Setup::

    INSTALLED_APPS = [..., "django.contrib.admin", "celery_boundedbeat.contrib.django"]

* Tables: created by ``manage.py boundedbeat_migrate`` or ``celery -A proj boundedbeat migrate``
  (Alembic); ``manage.py check`` warns (W002) while they are missing. The models are
  unmanaged and the app ships no Django migrations, so ``manage.py migrate`` and
  ``makemigrations --check`` leave them alone.
* Database: without ``CELERY_BOUNDEDBEAT_DATABASE_URL``, beat, the CLI and the admin all use
  Django's ``DATABASES["default"]`` (PostgreSQL or SQLite). When the URL points elsewhere, add
  a ``DATABASES`` alias for that database and name it in ``BOUNDEDBEAT_ADMIN_DATABASE`` (default
  ``"default"``); the admin reads through that alias and its actions write through the URL,
  so both must reach the same database (``manage.py check`` reports an unknown alias).
* Permissions: the pages need the ``view`` permission of each model (superusers have it);
  pause / resume / trigger also need ``celery_boundedbeat.operate_schedule``. Runtime
  schedules are added, changed and removed with ``celery_boundedbeat.add_schedule``,
  ``change_schedule`` and ``delete_schedule`` respectively, through the schedule API
  (``add_schedule()``, ``update_schedule()``, ``remove_schedule()``: the same validation and
  errors) with a Celery app configured from the Django settings (:func:`.conf.celery_app`).
  Config schedules (``beat_schedule``) and runs are read-only for everyone.
* Raw SQL: ``overlaps`` is a reserved word in PostgreSQL; quote it (``"overlaps"``).
"""
