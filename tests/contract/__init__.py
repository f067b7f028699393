"""The contract suite: one scenario, every backend (see conftest.py)."""
