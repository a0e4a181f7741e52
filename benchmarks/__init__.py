"""Benchmarks of dipaco: quality, communication, overhead, sync share, memory, routing, inference.

Run them all with ``python -m benchmarks --quick`` (see ``benchmarks/README.md``). Every
figure is a ratio of two sides measured in the same run, because the host is shared and
absolute timings move with other jobs' load.
"""
