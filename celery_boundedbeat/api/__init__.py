"""What applications call: runtime schedules, the transactional outbox, status and history reads."""
