"""The minimal Django project the admin tests run: admin, auth and celery_boundedbeat's app."""

from __future__ import annotations

from typing import Any

#: Trust authentication ignores it, so it can be as hostile as a real one: it must survive
#: URL escaping and must never show up in a page, a message or an error.
PASSWORD = "p@ss:w/rd%?#&"

#: ``CELERY_BEAT_SCHEDULE`` with per-entry policies, as a Django project would write it.
BEAT_SCHEDULE: dict[str, dict[str, Any]] = {
    "refresh-cache": {
        "task": "proj.tasks.refresh_cache",
        "schedule": 30.0,
        "policy": {"mode": "fixed_delay"},
    },
    "export-report": {
        "task": "proj.tasks.export_report",
        "schedule": 60.0,
        "policy": {"mode": "fixed_rate_no_overlap", "missed_ticks": "coalesce_latest"},
    },
    "poll-partner": {
        "task": "proj.tasks.poll_partner",
        "schedule": 10.0,
        "policy": {"mode": "fixed_rate", "max_concurrency": 2},
    },
}


#: The ``DATABASES`` alias of the SQLite file the admin tests also run the tables on.
SQLITE_ALIAS = "bb_sqlite"


def django_settings(database: str, sqlite_path: str) -> dict[str, Any]:
    """Settings for ``django.conf.settings.configure``.

    ``default`` and ``history`` reach the PostgreSQL ``database``; ``bb_sqlite`` is a SQLite
    file holding only the celery_boundedbeat tables (Django's own stay on PostgreSQL), the
    layout of a project whose ``CELERY_BOUNDEDBEAT_DATABASE_URL`` points elsewhere.
    """
    db = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": database,
        "USER": "postgres",
        "PASSWORD": PASSWORD,
        "HOST": "127.0.0.1",
        "PORT": "5432",
    }
    return {
        "SECRET_KEY": "celery-boundedbeat-tests-only",
        "DEBUG": False,
        "ALLOWED_HOSTS": ["testserver", "127.0.0.1"],
        "STATIC_URL": "/static/",
        "INSTALLED_APPS": [
            "django.contrib.admin",
            "django.contrib.auth",
            "django.contrib.contenttypes",
            "django.contrib.sessions",
            "django.contrib.messages",
            "django.contrib.staticfiles",
            "celery_boundedbeat.contrib.django",
        ],
        "MIDDLEWARE": [
            "django.contrib.sessions.middleware.SessionMiddleware",
            "django.middleware.common.CommonMiddleware",
            "django.middleware.csrf.CsrfViewMiddleware",
            "django.contrib.auth.middleware.AuthenticationMiddleware",
            "django.contrib.messages.middleware.MessageMiddleware",
        ],
        "ROOT_URLCONF": "bbtest_urls",
        "TEMPLATES": [
            {
                "BACKEND": "django.template.backends.django.DjangoTemplates",
                "APP_DIRS": True,
                "OPTIONS": {
                    "context_processors": [
                        "django.template.context_processors.request",
                        "django.contrib.auth.context_processors.auth",
                        "django.contrib.messages.context_processors.messages",
                    ]
                },
            }
        ],
        "DATABASES": {
            "default": dict(db),
            "history": dict(db),
            SQLITE_ALIAS: {"ENGINE": "django.db.backends.sqlite3", "NAME": sqlite_path},
        },
        "USE_TZ": True,
        "TIME_ZONE": "UTC",
        "DEFAULT_AUTO_FIELD": "django.db.models.BigAutoField",
        "PASSWORD_HASHERS": ["django.contrib.auth.hashers.MD5PasswordHasher"],
        "CELERY_BEAT_SCHEDULE": BEAT_SCHEDULE,
    }
