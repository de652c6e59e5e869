"""What registering a states slab with CUDA costs, and what it does to the copies a call issues meanwhile (GPU only).

Why: a worker registers each new slab with CUDA once (``cudaHostRegister``) so that copies into it are DMAs. A
slab made while a call runs (the caller still holds the earlier calls' results) was measured to hold that call's
copies up by as long as the registration took (issue: the first timed call of a run at 0.39x prefill). This
bench measures, side by side in one process:

- ``make``: memfd + fallocate + a populated mapping of ``--mib`` (what ``Slab.make`` did before pinning until it
  filled pages through the C library, with the GIL released; the kernel's work is the same), with and without
  ``MADV_HUGEPAGE`` (transparent huge pages for shared memory, where the kernel allows them);
- ``register``: ``cudaHostRegister`` of the whole slab, and of the same bytes in pieces of 2, 8 and 32 MiB;
- ``contention``: the host latency of each small device-to-host copy (into memory pinned long before) and of a small
  kernel launch issued by the main thread every ``--every-ms`` while another thread registers a fresh slab: whole, in
  pieces, in pieces under a lock the copying thread also takes (as the worker would), and nothing (the baseline);
- ``spanning``: a copy whose destination crosses the border of two separately registered pieces, against one inside
  a piece (whether the driver treats it as pinned: the call returns at once and the bandwidth is the bus's).

    python bench/pin_registration.py                 # 640 MiB slabs (a 512 MiB call and its 25 % headroom)
    python bench/pin_registration.py --mib 1280      # a 1 GiB call
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import threading
import time
from pathlib import Path

MIB = 1 << 20


def make_slab(nbytes: int, huge: bool) -> tuple[int, mmap.mmap, float]:
    """A sealed-size memfd slab with every page in place, as the worker makes one: (fd, mapping, seconds)."""
    started = time.perf_counter()
    fd = os.memfd_create("pin-bench", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    os.posix_fallocate(fd, 0, nbytes)
    if huge:
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        mapping.madvise(mmap.MADV_HUGEPAGE)
        populate = getattr(mmap, "MADV_POPULATE_WRITE", None)
        if populate is not None:
            mapping.madvise(populate)
        else:
            for at in range(0, nbytes, mmap.PAGESIZE):
                mapping[at] = 0
    else:
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    return fd, mapping, time.perf_counter() - started


def register(torch, address: int, nbytes: int, piece: int, pause: float = 0.0, lock=None) -> tuple[float, list]:
    """Register ``nbytes`` at ``address`` in pieces of ``piece`` bytes (0: whole): (seconds, registered pieces)."""
    cudart = torch.cuda.cudart()
    piece = piece or nbytes
    done = []
    started = time.perf_counter()
    for at in range(0, nbytes, piece):
        n = min(piece, nbytes - at)
        if lock is not None:
            with lock:
                rc = cudart.cudaHostRegister(address + at, n, 0)
        else:
            rc = cudart.cudaHostRegister(address + at, n, 0)
        if int(getattr(rc, "value", rc)) != 0:
            raise RuntimeError(f"cudaHostRegister returned {rc}")
        done.append(address + at)
        if pause:
            time.sleep(pause)
    return time.perf_counter() - started, done


def unregister(torch, pieces: list) -> float:
    started = time.perf_counter()
    for address in pieces:
        torch.cuda.cudart().cudaHostUnregister(address)
    return time.perf_counter() - started


def contention(torch, args, mode: str) -> dict:
    """Latencies of the main thread's copies and launches while a fresh slab registers in a thread (``mode``)."""
    nbytes = args.mib * MIB
    src = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty(4 * MIB, dtype=torch.uint8, pin_memory=True)
    small = torch.ones(1024, device="cuda")
    stream = torch.cuda.Stream()
    fd, mapping, _ = make_slab(nbytes, huge=mode.endswith("-huge"))
    block = torch.frombuffer(mapping, dtype=torch.uint8)
    lock = threading.Lock()
    done = threading.Event()
    reg: dict = {}

    def registrar() -> None:
        time.sleep(0.05)
        if mode.startswith("whole"):
            reg["seconds"], reg["pieces"] = register(torch, block.data_ptr(), nbytes, 0)
        elif mode == "pieces":
            reg["seconds"], reg["pieces"] = register(torch, block.data_ptr(), nbytes, 4 * MIB, pause=0.002)
        elif mode == "pieces-locked":
            reg["seconds"], reg["pieces"] = register(torch, block.data_ptr(), nbytes, 4 * MIB, 0.002, lock)
        else:
            time.sleep(0.3)
            reg["seconds"], reg["pieces"] = 0.3, []
        done.set()

    thread = threading.Thread(target=registrar)
    copies, launches = [], []
    torch.cuda.synchronize()
    thread.start()
    started = time.perf_counter()
    while not done.is_set() or time.perf_counter() - started < 0.1:
        t0 = time.perf_counter()
        small.add_(1)
        t1 = time.perf_counter()
        with lock, torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        t2 = time.perf_counter()
        launches.append(t1 - t0)
        copies.append(t2 - t1)
        time.sleep(args.every_ms / 1000)
        if time.perf_counter() - started > 10:
            break
    thread.join()
    torch.cuda.synchronize()
    unregister(torch, reg.get("pieces", []))
    block = None  # the mapping can close once no tensor views it
    mapping.close()
    os.close(fd)
    ms = [c * 1000 for c in copies]
    return {
        "mode": mode,
        "register_seconds": round(reg.get("seconds", 0.0), 4),
        "copies": len(copies),
        "copy_ms_median": round(statistics.median(ms), 3),
        "copy_ms_max": round(max(ms), 3),
        "copy_ms_sum": round(sum(ms), 2),
        "launch_ms_max": round(max(launches) * 1000, 3),
    }


def spanning(torch, args) -> dict:
    """A 32 MiB copy across the border of two registered pieces, against one inside a piece."""
    piece = 64 * MIB
    fd, mapping, _ = make_slab(2 * piece, huge=False)
    block = torch.frombuffer(mapping, dtype=torch.uint8)
    _, pieces = register(torch, block.data_ptr(), 2 * piece, piece)
    src = torch.empty(32 * MIB, dtype=torch.uint8, device="cuda")
    out = {}
    for name, offset in (("inside", 0), ("across", piece - 16 * MIB), ("inside", 0), ("across", piece - 16 * MIB)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            block.narrow(0, offset, src.numel()).copy_(src, non_blocking=True)
        except RuntimeError as exc:  # the driver refuses a copy across two registrations
            out[name] = {"error": str(exc).splitlines()[0]}
            break
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        out[name] = {
            "call_ms": round((t1 - t0) * 1000, 3),
            "done_ms": round((t2 - t0) * 1000, 3),
            "GB_s": round(src.numel() / (t2 - t0) / 1e9, 1),
        }
    unregister(torch, pieces)
    del block
    mapping.close()
    os.close(fd)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=640, help="slab size in MiB")
    parser.add_argument("--every-ms", type=float, default=1.0, help="the main thread copies every this many ms")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("pin_registration: no CUDA device; nothing to measure", file=sys.stderr)
        return 2
    torch.cuda.init()
    torch.empty(1, device="cuda")
    nbytes = args.mib * MIB
    thp = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    report: dict = {
        "mib": args.mib,
        "device": torch.cuda.get_device_name(),
        "shmem_enabled": thp.read_text().strip() if thp.exists() else "unknown",
    }
    rows = []
    for huge in (False, True):
        fd, mapping, made = make_slab(nbytes, huge)
        block = torch.frombuffer(mapping, dtype=torch.uint8)
        for piece_mib in (0, 32, 8, 2):
            seconds, pieces = register(torch, block.data_ptr(), nbytes, piece_mib * MIB)
            rows.append(
                {
                    "huge": huge,
                    "make_s": round(made, 4),
                    "piece_MiB": piece_mib or args.mib,
                    "register_s": round(seconds, 4),
                    "unregister_s": round(unregister(torch, pieces), 4),
                }
            )
        del block
        mapping.close()
        os.close(fd)
    t0 = time.perf_counter()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    report["torch_pin_memory_s"] = round(time.perf_counter() - t0, 4)
    del pinned
    report["register"] = rows
    modes = ("none", "whole", "whole-huge", "pieces", "pieces-locked")
    report["contention"] = [contention(torch, args, mode) for mode in modes]
    report["spanning"] = spanning(torch, args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
