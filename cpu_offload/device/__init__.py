"""The device: what the offloader asks of an accelerator, and the device's figures.

Holds the one module that calls a device runtime (``runtime.py``: ``torch.cuda``,
``torch.npu``), the backend protocol every other module uses for streams, events and
copies (``backend.py``), the link measurement, device profiles, and what kernels cost.

May import: errors, log.
"""
