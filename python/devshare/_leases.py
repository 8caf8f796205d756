"""What a consumer holds of a received item: its import, given back once, unmapped when garbage.

One job: the life of a received item's import. A :class:`Lease` gives it back to the producer
once (explicitly, or when it is garbage) and keeps it mapped until the last tensor over it is
gone, so that a tensor kept after the release never faults. A connection's :class:`Grave` keeps
its pool items' imports that are given back and garbage, for its next receive to release in
the library call it makes anyway. A :class:`PoolLease` is the lease of a pool item shown
through a view the connection keeps, and that view's :class:`Anchor` keeps the item's memory
mapped for whatever still uses it (``.numpy()``, ``.detach()``, ...) once the item is gone.
Receiving items and making their tensors is :mod:`devshare._connection`.

Imports :mod:`devshare._lib`, :mod:`devshare._channel_lib` and :mod:`devshare._ownership`.
"""

from __future__ import annotations

from ._channel_lib import GIVE_BACK, RAW_RELEASE, UNMAP_GIVEN_BACK, error
from ._lib import Error, ImportP, Status
from ._ownership import PID, forked

#: The most imports a grave keeps; past it a given-back import is unmapped at once.
MAX_GRAVE = 64


def release_import(pid, imp) -> None:
    """Give back and unmap ``imp`` (never given back), unless this is a forked child."""
    if PID[0] == pid:
        RAW_RELEASE(imp)


def unmap_import(pid, imp) -> None:
    """Unmap ``imp``, given back before, unless this is a forked child."""
    if PID[0] == pid:
        UNMAP_GIVEN_BACK(imp)


class Lease:
    """One received import (an ``ImportP``, or its address as an int: a pool item's, see
    :data:`devshare._connection.ItemOut`); given back once (explicitly or when it is garbage).
    Tensors made over it keep it alive (see :func:`devshare._views.view`).

    :meth:`release` gives the item back to the producer at once (:data:`GIVE_BACK
    <devshare._channel_lib.GIVE_BACK>`) but keeps the mapping until this object is garbage,
    that is, until the last tensor over it is gone: a tensor used after the release never
    faults (it reads what the producer writes there next). ``_held`` holds the import until the
    release takes it out: ``list.pop`` is atomic, so of two threads releasing at once exactly
    one gets it (the other: ALREADY_RELEASED). Garbage that was never released is released by
    ``__del__`` (not a weakref.finalize, which costs more than the rest of a receive), except in
    a process that inherited it through fork."""

    __slots__ = ("_held", "_pid", "_mapped", "_grave", "__weakref__")

    def __init__(self, imp: ImportP, grave=None):
        self._held = [imp]
        self._pid = PID[0]
        self._mapped = None  # the import, given back, until this object is garbage
        self._grave = grave  # a pool item's: where its import goes once given back and garbage

    @property
    def released(self) -> bool:
        return not self._held

    def release(self) -> None:
        if self._pid != PID[0]:
            raise forked("Item", self._pid)
        try:
            imp = self._held.pop()
        except IndexError:
            raise Error(Status.ALREADY_RELEASED, "this item was already released (it is given "
                                                 "back only once)") from None
        # From here on the import is unmapped only when this object is garbage (the last tensor
        # over it gone), also when the give-back fails. (A library before 1.2 unmaps it in the
        # give-back: its UNMAP_GIVEN_BACK does nothing.)
        self._mapped = imp
        status = GIVE_BACK(imp)
        if status < 0:
            raise error(status)

    def release_now(self) -> None:
        """Give back and unmap at once (no tensor was made over it)."""
        if self._held:
            status = RAW_RELEASE(self._held.pop())
            if status < 0:
                raise error(status)

    def __del__(self):
        try:
            if self._held:
                release_import(self._pid, self._held.pop())
            elif self._mapped is not None:
                imp, self._mapped = self._mapped, None
                grave = self._grave
                if grave is None or not grave.bury(imp, self._pid):
                    unmap_import(self._pid, imp)
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing to do in a finalizer
            pass


class Grave:
    """A connection's pool item imports that were given back and are garbage: the next receive
    releases one (``devshare_connection_recv_item``'s ``release``), in the library call it makes
    anyway, instead of a call of its own. Given back already, such an import only holds the
    pool's mapping (and its own few bytes) meanwhile. Bounded: past :data:`MAX_GRAVE` the import
    is released at once; the connection's close releases what is left (``open`` is cleared
    first, and an import buried after that is taken out by its own burier)."""

    __slots__ = ("imps", "open", "pid")

    def __init__(self):
        self.imps = []
        self.open = True
        self.pid = PID[0]

    def bury(self, imp, pid) -> bool:
        """Keep ``imp`` for the next receive; False when it must be released now."""
        imps = self.imps
        if not self.open or pid != self.pid or len(imps) >= MAX_GRAVE:
            return False
        imps.append(imp)
        if not self.open:  # closed meanwhile: release what is there (each pop is one import)
            self.empty()
        return True

    def take(self) -> int:
        """The address of an import to release (0: none)."""
        try:
            return self.imps.pop()
        except IndexError:
            return 0

    def empty(self) -> None:
        imps = self.imps
        while True:
            try:
                imp = imps.pop()
            except IndexError:
                return
            unmap_import(self.pid, imp)


class Anchor:
    """What the memory of a connection's kept item view holds (see
    :func:`devshare._connection.new_pool_view`): the lease of an item shown through it that is
    gone while something that is not a view of its tensor (``.numpy()``, ``.detach()``, ...)
    still uses that memory, so that the memory stays mapped for it; None when nothing needs
    that."""

    __slots__ = ("lease",)

    def __init__(self):
        self.lease = None


class PoolLease(Lease):
    """The lease of a pool item shown through a kept view: held by the item and by the item's
    tensor (and so by every torch view of that tensor, which keeps its base). When all of them
    are gone: the item goes back (if it was not released), and its import is unmapped unless
    something else still uses the view's memory, in which case the view's :class:`Anchor` keeps
    it mapped instead (until the next item of that slot and layout, which maps the same memory,
    or the view's end).

    ``entry`` is the kept view's entry: (tensor, storage, anchor, pool id, slot, the storage's
    users with nothing but the entry, what counts them or None, the storage's ``_cdata``)."""

    __slots__ = ("_entry",)

    def __init__(self, imp, grave, entry):
        self._held = [imp]
        self._pid = PID[0]
        self._mapped = None
        self._grave = grave
        self._entry = entry

    def __del__(self):
        try:
            entry = self._entry
            count = entry[6]
            if self._pid == PID[0] and (count is None or count(entry[7]) > entry[5]):
                # More users than the entry's own: the memory is still used. Back to the
                # producer, still mapped: the anchor takes the import (in a lease of its own;
                # this one is going).
                if self._held:
                    self.release()
                keep = Lease.__new__(Lease)
                keep._held, keep._pid, keep._grave = [], self._pid, self._grave
                keep._mapped, self._mapped = self._mapped, None
                entry[2].lease = keep
                return
            entry[2].lease = None  # nothing else uses it: the import goes with this lease
            imp = self._mapped
            if imp is not None and not self._held:
                # Released and garbage, the usual end: Lease.__del__ and Grave.bury, written
                # out (this is on every pool item's path; two calls would cost more than it).
                self._mapped = None
                grave = self._grave
                if grave is not None and grave.open and grave.pid == self._pid \
                        and len(grave.imps) < MAX_GRAVE:
                    grave.imps.append(imp)
                    if not grave.open:  # closed meanwhile
                        grave.empty()
                else:
                    unmap_import(self._pid, imp)
                return
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing to do in a finalizer
            pass
        Lease.__del__(self)
