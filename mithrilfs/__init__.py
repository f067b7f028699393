"""mithrilfs: a FUSE compile-cache filesystem over a blake3 content-addressed store."""

__version__ = "0.1.0"
