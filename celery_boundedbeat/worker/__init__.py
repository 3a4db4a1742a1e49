"""What runs in a Celery worker: signal receivers that record each run's start and end."""
