"""``python manage.py runserver`` serves the admin, with the run history when the
``celery_boundedbeat.contrib.django`` app is installed."""

from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
