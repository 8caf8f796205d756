"""Library objects owned by one process: the fork and thread rules of the channel objects.

One job: :class:`Owned`, the base of :class:`~devshare.Channel`, :class:`~devshare.Pool` and
:class:`~devshare.Connection`. The library object it holds is usable only in the process that
made it (a child that inherited it through ``fork`` gets :class:`RuntimeError`, and its garbage
collection of it closes nothing); it is closed exactly once (by ``close``, the garbage collector
or the interpreter's exit), and never while a call of another thread is inside it
(:class:`Life` counts those calls without a lock). :data:`PID` is this process's id without a
system call, for the per-item paths; :func:`forked` is the error a forked child gets.

Imports :mod:`devshare._lib` and :mod:`devshare._channel_lib`.
"""

from __future__ import annotations

import os
import threading
import weakref

from ._channel_lib import call
from ._lib import Error, Status

#: This process's id, as os.getpid() gives it, without a system call on every item's path:
#: refreshed in a child made by fork. (PID[0].)
PID = [os.getpid()]


def _refresh_pid() -> None:
    PID[0] = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_refresh_pid)


def forked(what: str, pid: int) -> RuntimeError:
    """The error for using a ``what`` of process ``pid`` in a child that inherited it."""
    return RuntimeError(
        f"this {what} belongs to process {pid}; process {os.getpid()} inherited it through fork() "
        f"and cannot use it (only the process that made it may). Connect again in this process "
        f"(devshare.connect(address)), or start workers with multiprocessing's 'spawn' method")


class Life:
    """The life of one library object: the threads inside calls on it, and whether it is open.

    Ending it (:meth:`end`: a garbage object's finalizer, the interpreter's exit, ``close``)
    closes the library object at once when no call is inside it, and otherwise when the last
    call leaves (:meth:`leave`): the library never frees an object a call is using, whatever
    thread ends it and when (a daemon thread inside ``Channel.service`` while the interpreter
    exits is the usual case).

    Without a lock on the calls' path (two lock round trips cost about 0.4 µs a call, a tenth of
    an item's trip): a call appends to ``inside`` and then reads ``open``; an end clears
    ``open`` and then looks at ``inside`` (through ``copy()``, which, like ``append`` and
    ``pop``, holds the list's own lock where there is no GIL). Whichever comes second sees the
    other: either the call sees the object closed, or the end sees the call and leaves the
    close to it (``deferred``; the call's exit looks at ``deferred`` after its ``pop``, and the
    end looks at ``inside`` again after setting it). ``token`` is taken (``pop``, atomic) by
    whoever closes, so the object is closed exactly once."""

    __slots__ = ("lock", "inside", "open", "deferred", "token", "pid", "closer", "ptr", "extra")

    def __init__(self, pid, closer, ptr, extra):
        self.lock = threading.Lock()  # serialises the ends (close, finalizer) only
        self.inside = []
        self.open = True
        self.deferred = False
        self.token = [True]
        self.pid = pid
        self.closer = closer
        self.ptr = ptr
        self.extra = extra

    def end(self) -> None:
        with self.lock:
            if not self.open:
                return
            self.open = False
        if self.inside.copy():
            self.deferred = True  # the last call out closes it
            if self.inside.copy():
                return
        self._close()

    def leave(self) -> None:
        """A call's exit (after its ``inside.pop()``) when ``deferred`` is set."""
        if not self.inside.copy():
            self._close()

    def _close(self) -> None:
        try:
            self.token.pop()
        except IndexError:
            return  # another thread closed it
        # In a child that inherited the object through fork, nothing: it is the parent's.
        if os.getpid() == self.pid:
            self.closer(self.ptr, *self.extra)


class Owned:
    """A library object (``_ptr``) this process made: usable only here, closed once.

    ``_fin`` (a weakref.finalize of its :class:`Life`) closes it when the object is garbage or
    the interpreter exits; it is alive while the object is open. Calls go through
    :meth:`_enter` / :meth:`_exit` (or :meth:`_lib_call`, which does both), which count the
    threads inside: :meth:`close` refuses to close the object under one of them, and a finalizer
    that runs meanwhile leaves the close to the last call out. The per-item calls (a pool's
    acquire, a slot's send, a connection's receive) write :meth:`_enter` / :meth:`_exit` out.
    """

    _what = "object"

    def _own(self, ptr, closer, *extra) -> None:
        self._pid = os.getpid()
        self._ptr = ptr
        self._life = Life(self._pid, closer, ptr, extra)
        self._fin = weakref.finalize(self, self._life.end)

    def _enter(self):
        life = self._life
        life.inside.append(None)
        # PID[0] is os.getpid() without the system call (kept by an at-fork hook).
        if not life.open or self._pid != PID[0]:
            return self._enter_refused()
        return self._ptr

    def _enter_refused(self):
        """:meth:`_enter` that saw the object closed or this process not its owner: raise (after
        leaving), unless it was a close that another thread's call made fail with ``BUSY``,
        which reopens the object while holding the lock."""
        life = self._life
        with life.lock:
            reopened = life.open
        if reopened and self._pid == os.getpid():
            return self._ptr
        self._exit()
        if self._pid != os.getpid():
            raise forked(self._what, self._pid)
        raise ValueError(f"the {self._what} is closed")

    def _try_enter(self):
        """:meth:`_enter` for finalizers: None instead of raising (and never waits for a lock:
        the collector may run a finalizer on a thread that holds one)."""
        life = self._life
        if not life.open or self._pid != os.getpid():
            return None
        life.inside.append(None)
        if not life.open:
            self._exit()
            return None
        return self._ptr

    def _exit(self) -> None:
        life = self._life
        life.inside.pop()
        if life.deferred:
            life.leave()

    def _lib_call(self, fn, *args) -> int:
        """``fn(<this object's pointer>, *args)`` through :func:`devshare._channel_lib.call`,
        inside :meth:`_enter` / :meth:`_exit`."""
        ptr = self._enter()
        try:
            return call(fn, ptr, *args)
        finally:
            self._exit()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (or the object was closed with its owner)."""
        return not self._fin.alive

    def close(self) -> None:
        """Close it (again: nothing happens). Refused with ``BUSY`` while another thread is
        inside one of its calls; RuntimeError in a process that inherited it through fork."""
        life = self._life
        with life.lock:
            if self._pid != os.getpid():
                raise forked(self._what, self._pid)
            if not self._fin.alive or not life.open:
                return
            life.open = False  # no call enters from here on (one that does meanwhile waits)
            busy = len(life.inside.copy())
            if busy:
                life.open = True
                raise Error(Status.BUSY, f"{self._what}.close(): {busy} call(s) of another "
                                         f"thread are still inside it")
            try:
                self._closing()
            except BaseException:
                life.open = True
                raise
        if self._fin.detach() is not None:
            life._close()

    def _closing(self) -> None:
        """Before the close: close what depends on this object."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce__(self):
        raise TypeError(f"a devshare {self._what} cannot be pickled or sent to another process: "
                        f"send the channel's address and connect there")
