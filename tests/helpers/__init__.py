"""Helpers shared by the test suites: a fixed clock origin and fake beats.

Import them as ``helpers.clock`` and ``helpers.beats``: ``tests/`` is on ``sys.path`` because
``tests/conftest.py`` is a rootless conftest (as ``pgtools`` is).
"""
