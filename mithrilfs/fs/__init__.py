"""The filesystem: the kernel's requests answered from the store (``operations``).

``operations`` holds the handlers, ``policy`` what a handler's failure
answers (and its latency), ``attributes`` the attributes every answer
carries.  ``daemon.wiring`` builds ``Operations`` from its ``Parts``.
"""

from .operations import Operations, Parts

__all__ = ["Operations", "Parts"]
