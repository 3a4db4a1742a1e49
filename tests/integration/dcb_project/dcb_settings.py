"""A Django project holding only django-celery-beat, on the database ``DCB_DATABASE`` names.

``DCB_DATABASE`` is ``sqlite:<path>`` or ``postgresql:<database name>`` (the test server).
Run in the processes the importer tests start (the writer, ``boundedbeat import``), never in
the test process itself.
"""

from __future__ import annotations

import os

_kind, _, _name = os.environ["DCB_DATABASE"].partition(":")
if _kind == "sqlite":
    _database = {"ENGINE": "django.db.backends.sqlite3", "NAME": _name}
else:
    _database = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _name,
        "USER": "postgres",
        "HOST": "127.0.0.1",
        "PORT": "5432",
    }

SECRET_KEY = "celery-boundedbeat-importer-tests-only"
INSTALLED_APPS = ["django_celery_beat"]
DATABASES = {"default": _database}
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
