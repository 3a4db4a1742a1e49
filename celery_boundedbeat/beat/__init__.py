"""What runs in ``celery beat``: the scheduler class, prepared ticks and the metrics endpoint."""
