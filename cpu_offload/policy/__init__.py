"""The policy: what each layer does with its saved tensors, and how that is chosen.

Holds the per-layer policy (keep, offload, checkpoint), checkpointing and selective
checkpointing, choices finer than a layer, finding a model's layers, memory budgets, the
measured step and the synchronizer whose policy changes between steps, how a handle
summarises what it hooked, and layers inside a reentrant checkpoint.

May import: engine, report, hooks, device, errors, log.
"""
