"""The shared stores: one interface (``base``), what every store holds, and one package per backend behind ``connect``."""
