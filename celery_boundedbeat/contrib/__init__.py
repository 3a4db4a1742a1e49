"""Optional integrations; nothing here is imported by the core package."""
