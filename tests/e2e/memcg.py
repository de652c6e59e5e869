"""A memory cgroup of its own for a test's process: a container's memory limit, on this machine.

Made under this process's own memory cgroup (cgroup v1's memory controller, or v2 where the parent delegates the
memory controller), limited to ``limit`` bytes; ``add(pid)`` moves a process in (what it allocates from then on is
charged there). None where cgroups cannot be made here (not root, no writable cgroup file system): callers skip.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path


class MemoryCgroup:
    def __init__(self, folder: Path, v2: bool) -> None:
        self.folder, self.v2 = folder, v2

    def add(self, pid: int) -> None:
        (self.folder / "cgroup.procs").write_text(str(pid))

    def peak(self) -> int | None:
        """The most it held at once (v1 always; v2 from kernel 5.19)."""
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        with contextlib.suppress(OSError, ValueError):
            return int((self.folder / name).read_text())
        return None

    def oom_kills(self) -> int:
        """Processes the kernel killed for this cgroup's limit."""
        text = (self.folder / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0


def _parent() -> tuple[Path, bool] | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _id, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            return (folder, False) if (folder / "memory.limit_in_bytes").exists() else None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _id, controllers, path = line.split(":", 2)
        if controllers == "":
            folder = Path("/sys/fs/cgroup") / path.lstrip("/")
            if "memory" in (folder / "cgroup.subtree_control").read_text().split():
                return folder, True
    return None


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[MemoryCgroup | None]:
    """A fresh memory cgroup limited to ``limit`` bytes (None where none can be made), removed afterwards."""
    try:
        found = _parent()
        if found is None:
            raise OSError("no memory cgroup to make one under")
        parent, v2 = found
        folder = parent / f"vllm-compat-test-{secrets.token_hex(4)}"
        folder.mkdir()
    except OSError:
        yield None
        return
    try:
        (folder / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limit))
        if not v2:
            with contextlib.suppress(OSError):  # no swap for its pages either, where the kernel accounts swap
                (folder / "memory.memsw.limit_in_bytes").write_text(str(limit))
        yield MemoryCgroup(folder, v2)
    finally:
        for pid in (folder / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (parent / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            os.rmdir(folder)
