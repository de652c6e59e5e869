"""The wire: the Unix socket over which each slab's descriptor goes from a worker to the generator's process.

Both ends live here. The generator's process makes one receiving socket (abstract, keyed) before it starts its
workers and gives them its address through the environment (``ENV_SOCKET``); each worker connects once, says who it
is (its token, its pid, the key), and then, at the end of every call, sends the slab's descriptor (``SCM_RIGHTS``)
with the hand-over's serial number before its RPC reply carries a small ``StatesHandle``. The receiver checks each
connection's peer (``SO_PEERCRED``: this user, the pid it claims) and gives a silent one ``_HELLO_TIMEOUT``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from vllm_compat.transport._libc import _libc
from vllm_compat.transport.layout import ENV_SOCKET, TransportError

logger = logging.getLogger("vllm_compat")

_HELLO = struct.Struct("<4s32sI32s")  # magic, worker token (hex), worker pid, the receiver's key (hex)
_MAGIC = b"VCS2"
_HEADER = struct.Struct("<QQ")  # serial, size: sent with each slab's descriptor
_RELEASED = struct.Struct("<Q")  # serial: sent back when the generator's process lets go of that hand-over's slab
_RECV_TIMEOUT = 30.0
_HELLO_TIMEOUT = 2.0  # a connection that has not said who it is by then is closed (a worker says it as it connects)


class _Channel:
    """The worker's connection to the generator's process, over which slab descriptors travel."""

    def __init__(self, address: str, key: str) -> None:
        self.token = secrets.token_hex(16)
        self.serial = 0  # hand-overs sent on this connection: the receiver reads them in this order
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self.sock.connect(address)
            self.sock.sendall(_HELLO.pack(_MAGIC, self.token.encode(), os.getpid(), key.encode()))
        except OSError:
            self.sock.close()
            raise
        self.lock = threading.Lock()
        threading.Thread(target=self._listen, name="vllm_compat_released", daemon=True).start()

    def _listen(self) -> None:
        """Read what the generator's process says back (the serial of each hand-over whose states it let go of) and
        have the worker's slabs looked at then, not at the next call: memory the caller dropped goes back when it
        drops it."""
        pending = b""
        while True:
            try:
                said = self.sock.recv(4096)  # several releases read at once are looked at once
            except OSError:
                return
            if not said:
                return  # the generator's process closed the connection
            pending += said
            whole = len(pending) - len(pending) % _RELEASED.size
            serials = [s for (s,) in _RELEASED.iter_unpack(pending[:whole])]
            pending = pending[whole:]
            for callback in list(_ON_RELEASE):
                try:
                    callback(serials)
                except Exception as exc:  # a release found late is only memory held longer
                    logger.debug("states-through-shared-memory: looking at released slabs failed (%r)", exc)

    def send(self, size: int, fd: int, slab: Any) -> int:
        """Pass ``slab``'s descriptor ``fd`` over; the hand-over's serial number (the slab is told it first: the
        caller may let go of the states before this returns)."""
        with self.lock:
            self.serial += 1
            slab.serial = self.serial
            socket.send_fds(self.sock, [_HEADER.pack(self.serial, size)], [fd])
            return self.serial


_CHANNEL: list[_Channel | None] = []
_ON_RELEASE: list[Callable[[list[int]], None]] = []


def when_released(callback: Callable[[list[int]], None]) -> None:
    """Call ``callback(serials)`` (in the worker, from the channel's thread) whenever the generator's process lets go
    of the states of hand-overs ``serials`` of this worker."""
    if callback not in _ON_RELEASE:
        _ON_RELEASE.append(callback)


def _channel() -> _Channel | None:
    """This worker's channel to the generator's process (None where it has none: the states then take the RPC
    reply, the slow way)."""
    if _CHANNEL:
        return _CHANNEL[0]
    address = os.environ.get(ENV_SOCKET)
    channel = None
    if address:
        try:
            channel = _Channel(*_decode_address(address))
        except OSError as exc:
            logger.warning(
                "states-through-shared-memory: cannot reach the generator's process at its socket (%s); captured "
                "states go through vLLM's message queue instead (slower)",
                exc.strerror or exc,
            )
    _CHANNEL.append(channel)
    return channel


def send_slab(slab: Any, used: int, spec: Any, pieces: list[tuple[int, int]]) -> StatesHandle | None:
    """Hand ``used`` bytes of ``slab`` over: its descriptor goes to the generator's process now, the returned handle
    travels in the RPC reply. None where this worker has no channel (the caller then replies the usual way)."""
    channel = _channel()
    if channel is None:
        return None
    slab.handed, slab.busy = True, False  # from now on, the generator's process's lock says when it is free
    try:
        serial = channel.send(used, slab.fd, slab)
    except OSError as exc:
        raise TransportError(f"cannot pass the states' descriptor to the generator's process ({exc})") from exc
    return StatesHandle(channel.token, os.getpid(), serial, used, spec, pieces)


class StatesHandle:
    """A picklable handle to one call's states; unpickling it (in the generator's process) receives the slab."""

    def __init__(self, token: str, pid: int, serial: int, size: int, spec: Any, pieces: list[tuple[int, int]]) -> None:
        self.token, self.pid, self.serial, self.size, self.spec, self.pieces = token, pid, serial, size, spec, pieces

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from vllm_compat.transport.caller import open_states  # the generator's process maps what it receives

        return (open_states, (self.token, self.pid, self.serial, self.size, self.spec, self.pieces))


def _encode_address(address: str, key: str) -> str:
    """The value of ``ENV_SOCKET``: the socket's address (``@`` for an abstract one) and the key a worker presents."""
    return ("@" + address[1:] if address.startswith("\0") else address) + "#" + key


def _decode_address(text: str) -> tuple[str, str]:
    address, _, key = text.rpartition("#")
    if not address:
        address, key = text, ""
    return ("\0" + address[1:] if address.startswith("@") else address), key


class _Pending:
    """A connection accepted but not yet known: the bytes of its hello so far, and when it must have said it all."""

    __slots__ = ("data", "deadline", "peer_pid", "peer_uid")

    def __init__(self, peer_pid: int, peer_uid: int) -> None:
        self.data = b""
        self.deadline = time.monotonic() + _HELLO_TIMEOUT
        self.peer_pid, self.peer_uid = peer_pid, peer_uid


class _Receiver:
    """The generator's process's socket: workers connect once and send each slab's descriptor before their reply.

    A connection is taken only from a process of this user that presents, with its own pid, the key this receiver
    gave its workers through the environment (``ENV_SOCKET``). Connections are read without blocking, each given
    ``_HELLO_TIMEOUT`` to say who it is: a stranger that connects and stays silent is closed then, and never holds up
    a worker's connection meanwhile."""

    def __init__(self) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        name = f"\0vllm-compat-{os.getpid()}-{secrets.token_hex(8)}"  # abstract: no file, gone with the process
        self.listener.bind(name)
        self.listener.listen(128)
        self.listener.setblocking(False)
        self.key = secrets.token_hex(16)
        self.address = _encode_address(name, self.key)
        self.pid = os.getpid()
        self.conns: dict[str, socket.socket] = {}  # worker token -> its connection
        self.pids: dict[str, int] = {}  # worker token -> its pid
        self.pending: dict[socket.socket, _Pending] = {}
        self.lock = threading.Lock()

    def receive(self, token: str, pid: int, serial: int, size: int) -> int:
        """The descriptor the worker ``token`` sent for hand-over ``serial``."""
        deadline = time.monotonic() + _RECV_TIMEOUT
        with self.lock:
            conn = self.conns.get(token) or self._accept_until(token, pid, deadline)
            while True:
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                try:
                    msg, fds, _flags, _addr = socket.recv_fds(conn, _HEADER.size, 1)
                except (TimeoutError, OSError) as exc:
                    raise TransportError(
                        f"no states descriptor from worker pid {pid} (hand-over {serial}): {exc}. Did the worker die?"
                    ) from exc
                if len(msg) != _HEADER.size or len(fds) != 1:
                    for fd in fds:
                        os.close(fd)
                    raise TransportError(f"worker pid {pid} sent a malformed states message ({len(msg)} bytes)")
                got, got_size = _HEADER.unpack(msg)
                if got == serial and got_size == size:
                    return fds[0]
                os.close(fds[0])  # an earlier hand-over whose reply never reached this process
                if got > serial:
                    raise TransportError(f"worker pid {pid} sent hand-over {got} while {serial} was expected")

    def discard(self, token: str, serial: int) -> None:
        """Close, without waiting, the descriptors worker ``token`` sent up to hand-over ``serial`` (its reply is being
        dropped: vllm_compat.recovery)."""
        with self.lock:
            conn = self.conns.get(token)
            if conn is None:
                return  # never accepted: the next receive from it skips the earlier hand-overs
            while True:
                try:
                    msg, fds, _flags, _addr = socket.recv_fds(conn, _HEADER.size, 1, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    return
                for fd in fds:
                    os.close(fd)
                if len(msg) != _HEADER.size or _HEADER.unpack(msg)[0] >= serial:
                    return

    def forget(self, pids: set[int]) -> None:
        """Close the connections of the worker processes ``pids`` (their executor was shut down)."""
        with self.lock:
            for token in [t for t, p in self.pids.items() if p in pids]:
                self._drop(token)

    def _drop(self, token: str) -> None:
        conn = self.conns.pop(token, None)
        self.pids.pop(token, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()

    def _prune(self) -> None:
        """Close the connections whose worker has gone (hung up), so none is kept for a process that exited."""
        poller = select.poll()
        by_fd = {}
        for token, conn in self.conns.items():
            by_fd[conn.fileno()] = token
            poller.register(conn, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        for fd, _events in poller.poll(0):
            self._drop(by_fd[fd])

    def _accept_until(self, token: str, pid: int, deadline: float) -> socket.socket:
        self._prune()
        with selectors.DefaultSelector() as selector:
            selector.register(self.listener, selectors.EVENT_READ)
            for conn in self.pending:
                selector.register(conn, selectors.EVENT_READ)
            while True:
                now = time.monotonic()
                for conn in [c for c, p in self.pending.items() if p.deadline <= now]:
                    self._refuse(selector, conn, "it did not say who it is in time")
                if now >= deadline:
                    raise TransportError(f"worker pid {pid} never connected to this process")
                wait = min([deadline, *(p.deadline for p in self.pending.values())]) - now
                for key, _events in selector.select(max(wait, 0.001)):
                    if key.fileobj is self.listener:
                        self._accept(selector)
                        continue
                    found = self._hello(selector, key.fileobj)
                    if found == token:
                        return self.conns[token]

    def _accept(self, selector: selectors.BaseSelector) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                logger.debug("states-through-shared-memory: accept failed (%s)", exc)
                return
            try:
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
                peer_pid, peer_uid, _gid = struct.unpack("3i", creds)
            except (OSError, struct.error):
                conn.close()
                continue
            if peer_uid != os.geteuid():
                logger.warning(
                    "states-through-shared-memory: refused a connection from pid %d (uid %d)", peer_pid, peer_uid
                )
                conn.close()
                continue
            conn.setblocking(False)
            self.pending[conn] = _Pending(peer_pid, peer_uid)
            selector.register(conn, selectors.EVENT_READ)

    def _hello(self, selector: selectors.BaseSelector, conn: Any) -> str | None:
        """Read what ``conn`` has sent of its hello; the worker's token once it is complete and right."""
        pending = self.pending[conn]
        try:
            part = conn.recv(_HELLO.size - len(pending.data))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            part = b""
        if not part:
            self._refuse(selector, conn, "it hung up before saying who it is", quiet=True)
            return None
        pending.data += part
        if len(pending.data) < _HELLO.size:
            return None
        magic, their_token, their_pid, key = _HELLO.unpack(pending.data)
        if magic != _MAGIC or their_pid != pending.peer_pid or not secrets.compare_digest(key, self.key.encode()):
            self._refuse(selector, conn, "it is not one of this process's vLLM workers")
            return None
        del self.pending[conn]
        selector.unregister(conn)
        conn.setblocking(True)
        token = their_token.decode()
        self.conns[token] = conn
        self.pids[token] = their_pid
        return token

    def _refuse(self, selector: selectors.BaseSelector, conn: Any, why: str, quiet: bool = False) -> None:
        pending = self.pending.pop(conn)
        selector.unregister(conn)
        conn.close()
        (logger.debug if quiet else logger.warning)(
            "states-through-shared-memory: refused a connection from pid %d (uid %d): %s",
            pending.peer_pid,
            pending.peer_uid,
            why,
        )


_RECEIVER: list[_Receiver] = []
_RECEIVER_LOCK = threading.Lock()


def current_receiver() -> _Receiver | None:
    """This process's receiving socket, where it made one (a forked child has none of its parent's)."""
    return _RECEIVER[0] if _RECEIVER and _RECEIVER[0].pid == os.getpid() else None


def tell_released(token: str, serial: int) -> None:
    """Tell worker ``token`` that this process let go of hand-over ``serial``'s slab (its lock is gone), never waiting.
    Called from a finalizer, in whatever thread drops the last tensor: it takes no lock, and a message that cannot be
    sent now only leaves the slab to be found free at the worker's next call."""
    receiver = current_receiver()
    conn = receiver.conns.get(token) if receiver is not None else None
    if conn is None:
        return
    message = _RELEASED.pack(serial)
    with contextlib.suppress(OSError, ValueError):  # a socket closed meanwhile: the worker is gone too
        # not socket.send: on a socket with a timeout it waits for room first, and a finalizer must never wait
        _libc().send(conn.fileno(), message, len(message), socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)


def forget_workers(pids: set[int]) -> None:
    """Close this process's connections from the worker processes ``pids`` (their executor was shut down)."""
    receiver = current_receiver()
    if receiver is not None and pids:
        receiver.forget(pids)


def receiver_address() -> str | None:
    """The address of this process's receiving socket (made on first use), for the workers it is about to start;
    None where it cannot be made (the states then take the RPC reply)."""
    with _RECEIVER_LOCK:
        if _RECEIVER and _RECEIVER[0].pid == os.getpid():
            return _RECEIVER[0].address
        _RECEIVER.clear()
        try:
            _RECEIVER.append(_Receiver())
        except OSError as exc:
            logger.warning("states-through-shared-memory: no receiving socket (%s); states take the RPC reply", exc)
            return None
        return _RECEIVER[0].address


def _forget_in_forked_child() -> None:
    """A forked child (a vLLM worker under the fork start method, a DataLoader worker) has no use for this process's
    socket or channel: it makes its own."""
    global _RECEIVER_LOCK
    _RECEIVER_LOCK = threading.Lock()
    for receiver in _RECEIVER:
        with contextlib.suppress(OSError):
            receiver.listener.close()
        for conn in [*receiver.conns.values(), *receiver.pending]:
            with contextlib.suppress(OSError):
                conn.close()
    _RECEIVER.clear()
    _CHANNEL.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_forked_child)
