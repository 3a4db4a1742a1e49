"""The tests that open a database (SQLite or PostgreSQL) but start no celery processes.

Their fixtures (``db_url``, ``sqlite_url``, ``postgres_url``, ``engine``, ``migrated``) are
shared with the other suites in ``tests/conftest.py``; ``tests/unit`` opens no database.
"""
