"""Integration tests: real celery beat and worker processes, real brokers and databases."""
