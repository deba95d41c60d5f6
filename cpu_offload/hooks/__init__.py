"""The hooks: autograd's saved-tensor hook machinery and what decides a tensor's fate.

Holds the hook stack (``autograd_hooks.py``), what a pack hook returns (``handles.py``),
the user's marks (``marking.py``, ``marks.py``), which saved tensors move
(``selection.py``, ``tensor_group.py``), module hooks and compiled layers'
entries (``compiled_entry.py``), and the small per-thread and
eager-only helpers the hook path uses.

May import: device, errors, log.
"""
