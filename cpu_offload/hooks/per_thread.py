"""State kept per thread, read cheaply."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["PerThread"]

T = TypeVar("T")


class PerThread(threading.local, Generic[T]):
    """One ``factory()`` object per thread, as :attr:`value`.

    Reading an attribute of a ``threading.local`` costs about ten times a plain
    attribute (it finds the thread's dictionary first), so the hooks read
    :attr:`value` once per call and then use a plain object.
    """

    def __init__(self, factory: Callable[[], T]) -> None:
        self.value: T = factory()
