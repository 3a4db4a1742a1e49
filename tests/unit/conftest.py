"""The unit suite opens no database: the tests that do are in ``tests/db``, and the database
fixtures (``db_url``, ``engine``, ``migrated``) are shared by every suite in ``tests/conftest.py``."""
