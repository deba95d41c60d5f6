"""``python -m cpu_offload.plan``'s parts, apart from the modes it runs (``__main__.py``):

- ``args.py``: the flags, their help and defaults, and their checks;
- ``tables.py``: what each mode prints (the table of every k, the policy, the stages);
- ``output.py``: what it writes (``--json``, ``--plot``).

``tables.py`` and ``output.py`` read the plans; ``args.py`` builds none.
"""
