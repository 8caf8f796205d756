"""The Handle class: a decoded, validated ``DevshareHandle``.

Decoding, encoding and validation all happen in the C library; this class only reads fields.
"""

from __future__ import annotations

import ctypes

from . import _dtypes
from ._lib import (
    BACKEND_NAMES,
    HANDLE_FLAG_INFLIGHT,
    HANDLE_MAX_ENCODED_SIZE,
    HANDLE_MAX_TEXT_SIZE,
    Error,
    HandleStruct,
    Status,
    call,
    error_for,
    lib,
    new_struct,
)


class Handle:
    """One shared tensor's handle: where its memory lives, its dtype, shape and strides, and the
    reference it carries. Handles are values: compare them with ``==``, send them as
    :meth:`to_bytes` or :meth:`to_text`, rebuild them with :meth:`from_bytes` / :meth:`from_text`
    (which validate every field). Each handle is one reference: give each consumer its own.
    """

    __slots__ = ("_h",)

    def __init__(self, struct: HandleStruct):
        if not isinstance(struct, HandleStruct):
            raise TypeError("use Handle.from_bytes() or Handle.from_text() to make a Handle")
        self._h = struct

    # --- construction and transport ---------------------------------------------------------

    @classmethod
    def _from_struct(cls, struct: HandleStruct) -> "Handle":
        copy = new_struct(HandleStruct)
        ctypes.memmove(ctypes.byref(copy), ctypes.byref(struct), ctypes.sizeof(HandleStruct))
        return cls(copy)

    @classmethod
    def from_bytes(cls, data) -> "Handle":
        """Decode and validate the canonical byte encoding (as :meth:`to_bytes` writes it)."""
        if isinstance(data, (bytearray, memoryview)):
            data = bytes(data)
        if not isinstance(data, bytes):
            raise TypeError(f"Handle.from_bytes() needs bytes, not {type(data).__name__}")
        h = new_struct(HandleStruct)
        call(lib.devshare_handle_decode, data, len(data), ctypes.byref(h))
        return cls(h)

    @classmethod
    def from_text(cls, text) -> "Handle":
        """Parse and validate the text form (``devshare1:...``; surrounding whitespace is ok)."""
        if isinstance(text, str):
            try:
                text = text.encode("ascii")
            except UnicodeEncodeError:
                # Let the library name the problem (it rejects characters outside its alphabet).
                text = text.encode("utf-8", "replace")
        if not isinstance(text, (bytes, bytearray)):
            raise TypeError(f"Handle.from_text() needs str, not {type(text).__name__}")
        text = bytes(text)
        if b"\0" in text:
            # The C function reads up to the first NUL: refuse rather than silently truncate.
            pos = text.index(b"\0")
            raise Error(Status.BAD_TEXT, f"handle text has a NUL character at offset {pos}")
        h = new_struct(HandleStruct)
        call(lib.devshare_handle_from_text, text, ctypes.byref(h))
        return cls(h)

    @classmethod
    def parse(cls, obj) -> "Handle":
        """A Handle from a Handle, its bytes or its text."""
        if isinstance(obj, Handle):
            return obj
        if isinstance(obj, str):
            return cls.from_text(obj)
        if isinstance(obj, (bytes, bytearray, memoryview)):
            data = bytes(obj)
            if data.lstrip().startswith(b"devshare"):
                return cls.from_text(data)
            return cls.from_bytes(data)
        raise TypeError(f"expected a devshare.Handle, its bytes or its text, not {type(obj).__name__}")

    @classmethod
    def from_torch_args(cls, args, backend: str = "cuda", producer_pid: int = 0) -> "Handle":
        """A handle from the 15 args ``torch.multiprocessing.reductions.reduce_tensor`` made for
        a CUDA (``backend="cuda"``) or NPU (``backend="npu"``) tensor (the tuple, or the
        ``(rebuild_fn, args)`` pair); see :func:`devshare.handle_from_torch`. Needs no GPU/NPU."""
        from ._torch_ipc import handle_from_torch

        return handle_from_torch(args, backend, producer_pid)

    def torch_args(self, device: int | None = None) -> tuple:
        """The 15 args for ``rebuild_cuda_tensor`` / ``rebuild_npu_tensor``; see
        :func:`devshare.torch_args`."""
        from ._torch_ipc import torch_args

        return torch_args(self, device)

    def _write(self, fn, cap: int, nul: int) -> bytes:
        # `cap` suffices for what this package's ABI version writes; a newer library may write
        # more (sections): it reports the length it needs, and the call is made again.
        n = ctypes.c_size_t()
        for _ in range(2):
            buf = ctypes.create_string_buffer(cap)
            status = fn(ctypes.byref(self._h), buf, len(buf), ctypes.byref(n))
            if status != Status.BUFFER_TOO_SMALL:
                break
            cap = n.value + nul
        if status < 0:
            raise error_for(status)
        return buf.raw[: n.value]

    def to_bytes(self) -> bytes:
        """The canonical byte encoding (CRC-protected; at most 606 bytes from a 1.0 library)."""
        return self._write(lib.devshare_handle_encode, HANDLE_MAX_ENCODED_SIZE, 0)

    def to_text(self) -> str:
        """The text form: ``devshare1:`` + URL-safe base64 (safe in argv, env and JSON)."""
        return self._write(lib.devshare_handle_to_text, HANDLE_MAX_TEXT_SIZE, 1).decode("ascii")

    def __str__(self) -> str:
        return self.to_text()

    def __reduce__(self):
        return (Handle.from_bytes, (self.to_bytes(),))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Handle):
            return NotImplemented
        return bytes(self._h) == bytes(other._h)

    def __hash__(self) -> int:
        return hash(bytes(self._h))

    def __repr__(self) -> str:
        try:
            dtype = _dtypes.type_name(*self.dtype)
        except ValueError:
            dtype = str(self.dtype)
        return (f"<devshare.Handle {self.backend} key={self.key.decode('latin-1')!r} dtype={dtype} "
                f"shape={self.shape} strides={self.strides} tensor_offset={self.tensor_offset} "
                f"storage_offset={self.storage_offset} storage_size={self.storage_size} "
                f"alloc_size={self.alloc_size} flags={self.flags:#x} producer_pid={self.producer_pid}>")

    # --- fields -------------------------------------------------------------------------------

    @property
    def backend(self) -> str:
        """Backend name: "host", "acl" or "cuda"."""
        return BACKEND_NAMES.get(self._h.backend, str(self._h.backend))

    @property
    def backend_id(self) -> int:
        return int(self._h.backend)

    @property
    def flags(self) -> int:
        """``DEVSHARE_HANDLE_FLAG_*`` bits."""
        return int(self._h.flags)

    @property
    def inflight(self) -> bool:
        """Whether the handle carries an in-flight reference its first import takes over."""
        return bool(self._h.flags & HANDLE_FLAG_INFLIGHT)

    @property
    def device_index(self) -> int:
        return int(self._h.device_index)

    @property
    def producer_pid(self) -> int:
        return int(self._h.producer_pid)

    @property
    def alloc_size(self) -> int:
        """Size in bytes of the exported allocation."""
        return int(self._h.alloc_size)

    @property
    def storage_offset(self) -> int:
        """Byte offset of the storage in the allocation."""
        return int(self._h.storage_offset)

    @property
    def storage_size(self) -> int:
        """Storage size in bytes."""
        return int(self._h.storage_size)

    @property
    def tensor_offset(self) -> int:
        """Element offset of the tensor's first element in its storage."""
        return int(self._h.tensor_offset)

    @property
    def dtype(self) -> tuple[int, int, int]:
        """DLPack (code, bits, lanes)."""
        d = self._h.dtype
        return (int(d.code), int(d.bits), int(d.lanes))

    @property
    def dtype_name(self) -> str:
        """torch/numpy spelling of the dtype ("float32", "bfloat16", ...)."""
        return _dtypes.type_name(*self.dtype)

    def torch_dtype(self):
        """The matching ``torch.dtype`` (imports torch)."""
        return _dtypes.to_torch(*self.dtype)

    def numpy_dtype(self):
        """The matching ``numpy.dtype``; TypeError for types numpy lacks (bfloat16, float8)."""
        return _dtypes.to_numpy(*self.dtype)

    @property
    def element_size(self) -> int:
        code, bits, lanes = self.dtype
        return bits // 8 * lanes

    @property
    def ndim(self) -> int:
        return int(self._h.ndim)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self._h.shape[: self._h.ndim])

    @property
    def strides(self) -> tuple[int, ...]:
        """Strides in elements."""
        return tuple(int(x) for x in self._h.strides[: self._h.ndim])

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def key(self) -> bytes:
        """Export key: the shm name for host handles (with its leading '/')."""
        return bytes(self._h.key[: self._h.key_len])

    @property
    def ref_name(self) -> bytes:
        """Name of the ref-counter shm object (empty when the handle carries none)."""
        return bytes(self._h.ref_name[: self._h.ref_name_len])

    @property
    def ref_slot(self) -> int:
        return int(self._h.ref_slot)

    @property
    def host_id(self) -> bytes:
        return bytes(self._h.host_id)

    @property
    def device_uuid(self) -> bytes:
        return bytes(self._h.device_uuid)
