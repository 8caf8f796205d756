"""DLPack capsules of imports, made with ctypes.

The C library makes the ``DLManagedTensorVersioned`` / ``DLManagedTensor``; each holds its own
reference to the import and its deleter releases that reference. This module wraps one in a
PyCapsule named ``"dltensor_versioned"`` / ``"dltensor"``. A consumer (torch.from_dlpack,
numpy.from_dlpack) renames the capsule to ``"used_..."`` and becomes responsible for calling the
deleter; a capsule that is never consumed calls the deleter when it is destroyed.

Imports only :mod:`devshare._lib`.
"""

from __future__ import annotations

import ctypes
from ctypes import CFUNCTYPE, c_char_p, c_int, c_void_p

from ._lib import error_for, lib

VERSIONED_NAME = b"dltensor_versioned"
LEGACY_NAME = b"dltensor"

# The capsule name must outlive the capsule: keep the C strings for the life of the module.
_VERSIONED_NAME = ctypes.create_string_buffer(VERSIONED_NAME)
_LEGACY_NAME = ctypes.create_string_buffer(LEGACY_NAME)

# dlpack.h 1.x layouts: DLManagedTensorVersioned {version (8); manager_ctx (8); deleter (8);
# flags (8); DLTensor (48)}, DLManagedTensor {DLTensor (48); manager_ctx (8); deleter (8)}.
_VERSIONED_DELETER_OFFSET = 16
_LEGACY_DELETER_OFFSET = 56

_DELETER = CFUNCTYPE(None, c_void_p)

# Private function objects (indexing makes a new one): attributes set on the shared
# ctypes.pythonapi.<name> objects could be changed by anyone else in the process.
_CAPSULE_DESTRUCTOR = CFUNCTYPE(None, c_void_p)
_PyCapsule_New = ctypes.pythonapi["PyCapsule_New"]
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [c_void_p, c_char_p, _CAPSULE_DESTRUCTOR]
# The destructor gets the dying capsule as a raw pointer: these take c_void_p, so no reference
# count is touched on an object that is being deallocated.
_PyCapsule_IsValid = ctypes.pythonapi["PyCapsule_IsValid"]
_PyCapsule_IsValid.restype = c_int
_PyCapsule_IsValid.argtypes = [c_void_p, c_char_p]
_PyCapsule_GetPointer = ctypes.pythonapi["PyCapsule_GetPointer"]
_PyCapsule_GetPointer.restype = c_void_p
_PyCapsule_GetPointer.argtypes = [c_void_p, c_char_p]


def call_deleter(managed: int, versioned: bool) -> None:
    """Run a managed tensor's own deleter (as a DLPack consumer does when it is done)."""
    offset = _VERSIONED_DELETER_OFFSET if versioned else _LEGACY_DELETER_OFFSET
    fn = c_void_p.from_address(managed + offset).value
    if fn:
        _DELETER(fn)(managed)


def _destroy(capsule: int, name) -> None:
    # Renamed ("used_...") means a consumer took the tensor over and owns the deleter call.
    if _PyCapsule_IsValid(capsule, name):
        managed = _PyCapsule_GetPointer(capsule, name)
        if managed:
            call_deleter(managed, name is _VERSIONED_NAME)


@_CAPSULE_DESTRUCTOR
def _destroy_versioned(capsule):  # pragma: no cover - runs from the capsule's dealloc
    _destroy(capsule, _VERSIONED_NAME)


@_CAPSULE_DESTRUCTOR
def _destroy_legacy(capsule):  # pragma: no cover - runs from the capsule's dealloc
    _destroy(capsule, _LEGACY_NAME)


def managed_from_import(imp, versioned: bool = True) -> int:
    """A new DLManagedTensor(Versioned) holding its own reference to ``imp`` (an ImportP)."""
    out = c_void_p()
    # (Not through call(): there is no integer to range-check, and this is every device item's
    # path.)
    if versioned:
        status = lib.devshare_import_to_dlpack_versioned(imp, ctypes.byref(out))
    else:
        status = lib.devshare_import_to_dlpack(imp, ctypes.byref(out))
    if status < 0:
        raise error_for(status)
    return out.value


def capsule(managed: int, versioned: bool = True):
    """Wrap a managed tensor in a PyCapsule that owns it until a consumer takes it over."""
    if versioned:
        return _PyCapsule_New(managed, _VERSIONED_NAME, _destroy_versioned)
    return _PyCapsule_New(managed, _LEGACY_NAME, _destroy_legacy)


class DLPackSource:
    """A one-shot object with ``__dlpack__`` / ``__dlpack_device__`` over one managed tensor,
    for consumers that only take such objects (``numpy.from_dlpack``). It hands its tensor to
    the first ``__dlpack__`` call; if nobody asks, dropping it runs the deleter.
    """

    def __init__(self, imp, device=(1, 0)):
        self._imp = imp
        self._device = device
        self._used = False

    def __dlpack_device__(self):
        return self._device

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if self._used:
            raise BufferError("this DLPack source was already consumed")
        if copy:
            raise BufferError("devshare imports are shared, never copied (copy=True)")
        if dl_device is not None and tuple(dl_device) != tuple(self._device):
            raise BufferError(f"the tensor lives on DLPack device {self._device}, not {dl_device}")
        versioned = max_version is not None and tuple(max_version) >= (1, 0)
        managed = managed_from_import(self._imp, versioned)
        self._used = True
        return capsule(managed, versioned)
