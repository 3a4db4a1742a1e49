"""Settings and schedule entries read from Celery's configuration, validated into specs."""
