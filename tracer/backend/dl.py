"""Which shared library really serves a symbol in this process (``dladdr``)."""

from __future__ import annotations

import ctypes
import os
from typing import Optional


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p), ("dli_sname", ctypes.c_char_p),
                ("dli_saddr", ctypes.c_void_p)]


def defining_library(symbol: str) -> Optional[str]:
    """The file that defines ``symbol`` first in this process's global scope
    (what a library loaded now binds to); None if no library there does."""
    try:
        process = ctypes.CDLL(None)
        addr = ctypes.cast(getattr(process, symbol), ctypes.c_void_p).value
        info = _DlInfo()
        if process.dladdr(ctypes.c_void_p(addr), ctypes.byref(info)) and info.dli_fname:
            return os.path.realpath(info.dli_fname.decode())
    except (AttributeError, OSError):
        pass
    return None
