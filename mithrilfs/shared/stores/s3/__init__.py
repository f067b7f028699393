"""The shared tier in an S3-compatible bucket."""
