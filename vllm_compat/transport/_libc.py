"""The C library's ``mmap``, ``munmap`` and ``madvise`` through ctypes: calls that release the GIL, and mappings whose
life the caller decides (used by the worker's slabs and by the generator's private mappings)."""

from __future__ import annotations

import ctypes


class _Libc:
    """``mmap``/``munmap`` from the C library: the mapping's life is then the buffer's, and the lease (one descriptor
    with its lock) is held by the buffer's finalizer alone. ``send``: a message that must never wait."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols, libc's among them: no library search
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self.munmap = libc.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.madvise = libc.madvise
        self.madvise.restype = ctypes.c_int
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.send = libc.send  # with MSG_DONTWAIT: never waits, whatever timeout Python set on the socket
        self.send.restype = ctypes.c_ssize_t
        self.send.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]


_LIBC: list[_Libc] = []
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> _Libc:
    if not _LIBC:
        _LIBC.append(_Libc())
    return _LIBC[0]
