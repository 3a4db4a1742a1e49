"""Unit-suite fixtures: the database fixtures (``db_url``, ``engine``, ``migrated``) are shared
with the other suites in ``tests/conftest.py``."""
