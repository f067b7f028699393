"""The shared tier in this process's memory: a backend for unit tests (``store``, ``gc``, ``feed``)."""
