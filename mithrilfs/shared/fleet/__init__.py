"""Keeping the fleet within budget: fleet gc, use records, the last gc's summary."""
