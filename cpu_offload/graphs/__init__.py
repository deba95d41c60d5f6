"""CUDA graphs: the offloader inside a captured step and its replays (``cuda_graph=``).

Holds what ``cuda_graph=`` accepts and refuses (``graph_options.py``) and the
synchronizer that schedules the copies of a captured step so that a replay repeats them
(``graph_synchronizer.py``: fixed host buffers, copy streams forked from and joined to
the capturing stream, nothing decided per step outside the graph).

May import: engine, report, hooks, device, errors, log.
"""
