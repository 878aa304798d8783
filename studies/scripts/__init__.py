"""Measurements and plots that the write-ups of the studies cite, each run as ``python -m studies.scripts.NAME ...``."""
