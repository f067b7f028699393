"""Redis in front of a bucket: one store, read front first, written to both."""
