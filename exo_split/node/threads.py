"""The node's one compute thread, named for the OS so tools can tell it apart."""

from __future__ import annotations

import contextlib
import ctypes
import sys

COMPUTE_THREAD = "exo-compute"  # its name for the OS: top -H, /proc/<pid>/task/*/comm


def name_thread(name: str) -> None:
    """Name the calling thread for the OS (Linux; elsewhere nothing happens), so tools that
    list a process's threads (top -H, the benchmark's CPU accounting) can tell it apart.
    Threads it starts afterwards inherit the name."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
