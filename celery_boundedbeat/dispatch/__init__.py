"""The dispatcher: drains the database queue to the broker (runs inside beat, or on its own)."""
