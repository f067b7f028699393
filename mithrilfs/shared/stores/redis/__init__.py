"""The shared tier in Redis or a Redis Cluster."""
