"""Pure decisions: values in, values out, no SQL, Celery or Django (policies, ticks, grids, errors)."""
