"""Fault tests: dead workers, time limits, several beats, database outages, late signals."""
