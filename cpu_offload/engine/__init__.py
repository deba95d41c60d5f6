"""The engine: the mechanism that moves one layer's saved tensors and brings them back.

Holds the layer state machine (``transitions.py``, ``layer_state.py``), a layer's data
and copies (``layer_data.py``), the host pool (``host_buffers.py``), the schedule and the
synchronizers (the manual one in ``manual_synchronizer.py``), forward passes and which
of them move whole (``pass_schedule.py``: ``keep_passes``), the engine a context's layer
states share, the chunk engine of a whole forward, and the context a layer runs in
(``layer_context.py``).

May import: report, hooks, device, errors, log.
"""
