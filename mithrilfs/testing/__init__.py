"""What the tests and the benchmarks run mithrilfs against, importable by both (``trio.testing``'s place).

``delay_proxy``: a TCP proxy in front of a redis-server or an S3 gateway that
adds a round trip to each exchange and counts the requests (``framing``
cuts the client's bytes into requests); ``python -m
mithrilfs.testing.delay_proxy --help`` runs it alone.  ``weed``: what a
SeaweedFS started by a test or a benchmark leaves in /tmp, removed.
``own_namespace``: a command in a mount namespace of its own that holds
none of the other tests' FUSE mounts (a copy would keep them alive).
Nothing of the product imports this package (import-linter's layers).
"""
