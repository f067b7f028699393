"""Warming a node from the shared tier: its startup set recorded, ordered and prefetched."""
