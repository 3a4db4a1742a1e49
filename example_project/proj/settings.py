"""Settings of the celery_boundedbeat example project.

Defaults need no server: a SQLite file and the ``filesystem://`` broker, both under
``demo-state/`` at the repository root (override with ``BOUNDEDBEAT_DEMO_STATE_DIR``).
Two environment variables switch to real servers:

    BOUNDEDBEAT_DEMO_DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1:5432/test
    BOUNDEDBEAT_DEMO_BROKER_URL=amqp://guest:guest@127.0.0.1:5672//
"""

import importlib.util
import os
from pathlib import Path

from sqlalchemy.engine import make_url

BASE_DIR = Path(__file__).resolve().parent.parent
STATE_DIR = Path(os.environ.get("BOUNDEDBEAT_DEMO_STATE_DIR", BASE_DIR.parent / "demo-state")).resolve()
STATE_DIR.mkdir(parents=True, exist_ok=True)

SECRET_KEY = "demo-only-not-secret"  # a throwaway demo project: never deploy it
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "demoapp",
]


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


# The admin over the schedules and the run history (guarded so the demo runs without it).
if _importable("celery_boundedbeat.contrib.django"):
    INSTALLED_APPS.append("celery_boundedbeat.contrib.django")

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "proj.urls"
TEMPLATES = [
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
]
STATIC_URL = "static/"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# -- one database for Django and celery_boundedbeat (so the admin sees the history) --------

DATABASE_URL = os.environ.get("BOUNDEDBEAT_DEMO_DATABASE_URL") or f"sqlite:///{STATE_DIR / 'demo.sqlite3'}"
_url = make_url(DATABASE_URL)
if _url.get_backend_name() == "postgresql":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": _url.database or "postgres",
            "USER": _url.username or "",
            "PASSWORD": _url.password or "",
            "HOST": _url.host or "",
            "PORT": str(_url.port or ""),
        }
    }
else:
    DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": _url.database}}

CELERY_BOUNDEDBEAT_DATABASE_URL = DATABASE_URL

# -- broker -----------------------------------------------------------------------------

CELERY_BROKER_URL = os.environ.get("BOUNDEDBEAT_DEMO_BROKER_URL") or "filesystem://"
if CELERY_BROKER_URL.startswith("filesystem://"):
    _broker = STATE_DIR / "broker"
    for _folder in ("queue", "processed", "control"):
        (_broker / _folder).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker / "queue"),
        "data_folder_out": str(_broker / "queue"),
        "processed_folder": str(_broker / "processed"),
        "control_folder": str(_broker / "control"),
        "store_processed": False,
        "polling_interval": 0.1,
    }

CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# -- beat ---------------------------------------------------------------------------------

CELERY_BEAT_SCHEDULER = "celery_boundedbeat.Scheduler"
CELERY_BEAT_SCHEDULE = {
    # Next run 3 s after the previous one finished (stock beat has no such mode).
    "refresh-cache": {
        "task": "demoapp.tasks.refresh_cache",
        "schedule": 3.0,
        "args": (1.0,),
        "policy": {"mode": "fixed_delay"},
    },
    # A 5 s task on a 2 s grid: never two at once; missed ticks collapse into one pending run.
    "export-report": {
        "task": "demoapp.tasks.export_report",
        "schedule": 2.0,
        "args": (5.0,),
        "policy": {"mode": "fixed_rate_no_overlap", "missed_ticks": "coalesce_latest"},
    },
    # A 2.5 s task every second: at most two at once; a tick finding both busy is skipped.
    "poll-partner": {
        "task": "demoapp.tasks.poll_partner",
        "schedule": 1.0,
        "args": (2.5,),
        "policy": {"mode": "fixed_rate", "max_concurrency": 2, "missed_ticks": "skip"},
    },
}
