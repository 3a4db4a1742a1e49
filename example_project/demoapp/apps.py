from django.apps import AppConfig


class DemoappConfig(AppConfig):
    name = "demoapp"
    default_auto_field = "django.db.models.BigAutoField"
