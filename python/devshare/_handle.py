"""The Handle class: a decoded, validated ``DevshareHandle``.

Decoding, encoding and validation all happen in the C library; this class only reads fields.

Segmented (expandable-segment) handles whose segment table is too long for the fixed-size struct
(more than ``KEY_CAPACITY`` = 128 bytes of records: over 16 torch_npu segments, 32 CUDA fds or 2
CUDA fabric handles) carry the table only in their byte encoding. Such a Handle keeps that
encoding next to the struct: :meth:`Handle.to_bytes` / :meth:`Handle.to_text` return it, and
imports go through ``devshare_import_encoded``.

One job: the handle as a value (construction, transport forms, fields); it owns no memory and
imports nothing. :func:`struct_of` gives the other modules the struct to pass to the library.

Imports :mod:`devshare._lib`, :mod:`devshare._dtypes`, :mod:`devshare._handle_struct` and
:mod:`devshare._torch_tuples` (:meth:`Handle.from_torch_args`, :meth:`Handle.torch_args`).
"""

from __future__ import annotations

import base64
import ctypes

from . import _dtypes, _torch_tuples
from ._handle_struct import SEGMENT_KINDS, external_table, segments_record, table_in_encoding
from ._lib import (
    BACKEND_HOST,
    BACKEND_NAMES,
    HANDLE_FLAG_INFLIGHT,
    HANDLE_FLAG_SEGMENTED,
    HANDLE_MAX_ENCODED_SIZE,
    HANDLE_MAX_TEXT_SIZE,
    SEGMENTS_CUDA_FABRIC,
    SEGMENTS_CUDA_FD,
    Error,
    HandleStruct,
    Status,
    call,
    error_for,
    lib,
    new_struct,
)

_TEXT_PREFIX = b"devshare1:"
# Bytes before the data in a host (file_system layout) shm object.
_HOST_HEADER = 64


class Handle:
    """One shared tensor's handle: where its memory lives, its dtype, shape and strides, and the
    reference it carries. Handles are values: compare them with ``==``, send them as
    :meth:`to_bytes` or :meth:`to_text`, rebuild them with :meth:`from_bytes` / :meth:`from_text`
    (which validate every field). Each handle is one reference: give each consumer its own.
    """

    __slots__ = ("_h", "_encoded")

    def __init__(self, struct: HandleStruct, encoded: bytes | None = None):
        if not isinstance(struct, HandleStruct):
            raise TypeError("use Handle.from_bytes() or Handle.from_text() to make a Handle")
        self._h = struct
        # The full byte encoding, kept only when the struct cannot hold everything: a segmented
        # handle whose segment table is not inline (it travels in the encoding only).
        if external_table(struct):
            if encoded is None:
                raise ValueError("a segmented handle whose segment table is not inline needs its "
                                 "byte encoding (use Handle.from_bytes / from_text)")
            self._encoded = bytes(encoded)
        else:
            self._encoded = None

    # --- construction and transport ---------------------------------------------------------

    @classmethod
    def _from_struct(cls, struct: HandleStruct, encoded: bytes | None = None) -> "Handle":
        copy = new_struct(HandleStruct)
        ctypes.memmove(ctypes.byref(copy), ctypes.byref(struct), ctypes.sizeof(HandleStruct))
        return cls(copy, encoded)

    @classmethod
    def from_bytes(cls, data) -> "Handle":
        """Decode and validate the canonical byte encoding (as :meth:`to_bytes` writes it)."""
        if isinstance(data, (bytearray, memoryview)):
            data = bytes(data)
        if not isinstance(data, bytes):
            raise TypeError(f"Handle.from_bytes() needs bytes, not {type(data).__name__}")
        h = new_struct(HandleStruct)
        call(lib.devshare_handle_decode, data, len(data), ctypes.byref(h))
        return cls(h, data)

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
        if not external_table(h):
            return cls(h)
        # The table travelled in the text only: keep the bytes it encodes (valid, as just checked).
        body = text.strip()[len(_TEXT_PREFIX):]
        return cls(h, base64.urlsafe_b64decode(body + b"=" * (-len(body) % 4)))

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
        return cls(*_torch_tuples.struct_from_args(args, backend, producer_pid))

    def torch_args(self, device: int | None = None) -> tuple:
        """The 15 args for ``rebuild_cuda_tensor`` / ``rebuild_npu_tensor``; see
        :func:`devshare.torch_args`."""
        table = None if self._encoded is None else self.segment_table
        return _torch_tuples.args_of(self._h, table, device)

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
        """The canonical byte encoding (CRC-protected; at most 606 bytes from a 1.0 library, more
        for a segmented handle whose segment table travels with it)."""
        if self._encoded is not None:
            return self._encoded
        return self._write(lib.devshare_handle_encode, HANDLE_MAX_ENCODED_SIZE, 0)

    def to_text(self) -> str:
        """The text form: ``devshare1:`` + URL-safe base64 (safe in argv, env and JSON)."""
        if self._encoded is not None:
            body = base64.urlsafe_b64encode(self._encoded).rstrip(b"=")
            return (_TEXT_PREFIX + body).decode("ascii")
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
        if self.segmented:
            where = (f"segments={self.segment_count}x{self.segment_size} ({self.segment_kind}"
                     f"{'' if self._encoded is None else ', table in the encoding'})")
        else:
            where = f"key={self.key.decode('latin-1')!r}"
        return (f"<devshare.Handle {self.backend} {where} dtype={dtype} "
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
        """Export key: the shm name for host handles (with its leading '/'); for a segmented
        handle its inline segment table (empty when the table is not inline)."""
        return bytes(self._h.key[: self._h.key_len])

    # --- segmented (expandable-segment) handles -------------------------------------------------

    @property
    def segmented(self) -> bool:
        """Whether the allocation is a list of equal VMM segments (PyTorch's / torch_npu's
        expandable segments, or a C producer's ``devshare_export_segments``)."""
        return bool(self._h.flags & HANDLE_FLAG_SEGMENTED)

    @property
    def segment_size(self) -> int:
        """Bytes per segment (0 for a handle that is not segmented)."""
        seg = segments_record(self._h)
        return seg[0] if seg else 0

    @property
    def segment_count(self) -> int:
        """Number of segments (0 for a handle that is not segmented); ``alloc_size`` is
        ``segment_count * segment_size`` and ``storage_offset`` counts from the first segment."""
        seg = segments_record(self._h)
        return seg[1] if seg else 0

    @property
    def segment_kind(self) -> str | None:
        """What the segment table holds: ``"acl"`` (u64 shareable handles), ``"cuda_fd"`` (POSIX
        fd numbers valid in ``producer_pid``) or ``"cuda_fabric"`` (64-byte fabric handles);
        None for a handle that is not segmented."""
        seg = segments_record(self._h)
        return SEGMENT_KINDS[seg[2]][0] if seg else None

    @property
    def segment_table(self) -> bytes:
        """The segment table in devshare's form (``segment_count`` little-endian records, in
        address order), wherever it is kept; empty for a handle that is not segmented."""
        seg = segments_record(self._h)
        if seg is None:
            return b""
        if seg[3]:
            return self.key
        return table_in_encoding(self._h, self._encoded, seg[1], seg[2], seg[4])

    @property
    def segments(self) -> tuple:
        """The segment table as Python values: ints (acl shareable handles, cuda fd numbers) or
        64-byte ``bytes`` (cuda fabric handles); empty for a handle that is not segmented."""
        seg = segments_record(self._h)
        if seg is None:
            return ()
        size = SEGMENT_KINDS[seg[2]][1]
        table = self.segment_table
        if seg[2] == SEGMENTS_CUDA_FABRIC:
            return tuple(table[i:i + size] for i in range(0, len(table), size))
        signed = seg[2] == SEGMENTS_CUDA_FD
        return tuple(int.from_bytes(table[i:i + size], "little", signed=signed)
                     for i in range(0, len(table), size))

    @property
    def table_inline(self) -> bool:
        """False for a segmented handle whose table travels only in its encoding (it is then
        imported with ``devshare_import_encoded``); True otherwise."""
        return self._encoded is None

    def mapping_info(self) -> dict:
        """What a consumer without devshare (stock PyTorch, numpy, any language) needs to map
        this host handle's memory itself and to return its reference, as a JSON-ready dict:

        - ``path``: the shm object, ``"/dev/shm" + key`` (PyTorch's ``file_system`` layout: a
          64-byte header, then the data);
        - ``size``: the bytes the object holds at least (``64 + alloc_size``);
        - ``offset``: byte offset of the tensor's storage in the object (``64 + storage_offset``);
          ``storage_size``: its bytes;
        - ``dtype`` (torch/numpy name), ``shape``, ``strides`` (elements), ``tensor_offset``
          (elements from the storage's start);
        - ``ref_path`` / ``ref_slot``: the ref-counter object and slot that hold this handle's
          reference (the slot is 1 until the consumer sets it to 0); ``ref_path`` None when the
          handle carries no reference.

        docs/formats.md ("Interop with PyTorch CPU tensors") has a stock consumer that maps
        the object with ``mmap`` and ``torch.frombuffer`` without counting itself in or
        unlinking anything. ValueError for device handles (use :meth:`torch_args`) and for a
        handle with an in-flight reference: only a devshare import can take that over (share
        with ``devshare.share(obj, inflight=False)`` for such consumers).
        """
        if self.backend_id != BACKEND_HOST:
            raise ValueError(f"mapping_info() describes host handles; a {self.backend} handle opens "
                             f"through PyTorch's IPC (torch_args())")
        if self.inflight:
            raise ValueError("this handle carries an in-flight reference, which only a devshare "
                             "import can take over (a consumer mapping the object itself would "
                             "leave its count in the header, and the object in /dev/shm, forever): "
                             "share it with devshare.share(obj, inflight=False)")
        ref = self.ref_name
        return {
            "path": "/dev/shm" + self.key.decode("ascii"),
            "size": _HOST_HEADER + self.alloc_size,
            "offset": _HOST_HEADER + self.storage_offset,
            "storage_size": self.storage_size,
            "dtype": self.dtype_name,
            "shape": list(self.shape),
            "strides": list(self.strides),
            "tensor_offset": self.tensor_offset,
            "ref_path": "/dev/shm" + ref.decode("ascii") if ref else None,
            "ref_slot": self.ref_slot,
        }

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


def struct_of(handle: Handle) -> HandleStruct:
    """The validated ``DevshareHandle`` struct a :class:`Handle` holds, for the modules that pass
    it to the library (``byref(struct_of(h))``). Do not change it: handles are values."""
    return handle._h
