"""Benchmarks for ``minidist bench NAME``: one module each, with ``add_arguments`` and ``run``."""
