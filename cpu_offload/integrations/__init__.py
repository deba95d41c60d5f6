"""Integrations with host libraries, one module per library; each imports its library lazily.

May import: plan, policy, report, hooks, context, layer_hooks, chunked, log.
"""
