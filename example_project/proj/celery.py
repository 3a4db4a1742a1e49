"""The Celery app: Django settings with the ``CELERY_`` prefix, plus celery_boundedbeat."""

import os

from celery import Celery

import celery_boundedbeat

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")

app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
celery_boundedbeat.install(app)  # worker-side run tracking (started / completed / failed ...)
