"""Keeping names and content in sync with the shared tier: read-through, write-behind, the change feed, forget."""
