"""The report: what the offloader did, counted as it happens and told afterwards.

Holds the statistics (``stats.py``), the step record and the step report, the copy timer
and the profiler ranges.

May import: hooks, device, errors, log.
"""
