"""Reading a library-validated ``DevshareHandle`` struct beyond its plain fields.

One job: the segment description of a segmented (expandable-segment) handle, whether its
segment table is inline (in the struct's key) or travels only in the byte encoding, and where
that table is in the encoding. The library decodes and validates handles; this module only
reads what it wrote, for :mod:`devshare._handle` and :mod:`devshare._torch_tuples`.

Imports only :mod:`devshare._lib`.
"""

from __future__ import annotations

import zlib

from ._lib import (
    EXT_SEGMENTS,
    HANDLE_FLAG_EVENT,
    HANDLE_FLAG_SEGMENTED,
    SEGMENTS_ACL,
    SEGMENTS_CUDA_FABRIC,
    SEGMENTS_CUDA_FD,
    SEGMENTS_INLINE,
    Error,
    HandleStruct,
    Status,
)

#: Segment table kind -> (name, bytes per record).
SEGMENT_KINDS = {SEGMENTS_ACL: ("acl", 8), SEGMENTS_CUDA_FD: ("cuda_fd", 4),
                 SEGMENTS_CUDA_FABRIC: ("cuda_fabric", 64)}
# Bytes of the encoding before the shape (magic .. dtype; see src/handle/encode.rs).
_ENC_FIXED = 12 + 2 + 1 + 1 + 4 + 4 + 4 + 16 + 16 + 8 * 4 + 4


def segments_record(h: HandleStruct):
    """(segment_size, count, kind, inline, table_crc) of a segmented handle's description, or None."""
    if not h.flags & HANDLE_FLAG_SEGMENTED:
        return None
    ext = bytes(h.ext[: h.ext_len])
    i = 0
    while i + 4 <= len(ext):
        kind = int.from_bytes(ext[i:i + 2], "little")
        n = int.from_bytes(ext[i + 2:i + 4], "little")
        data = ext[i + 4:i + 4 + n]
        if kind == EXT_SEGMENTS and len(data) == 20:
            return (int.from_bytes(data[0:8], "little"), int.from_bytes(data[8:12], "little"),
                    int.from_bytes(data[12:14], "little"),
                    bool(int.from_bytes(data[14:16], "little") & SEGMENTS_INLINE),
                    int.from_bytes(data[16:20], "little"))
        i += 4 + n
    return None  # the library validated the handle: not reached


def external_table(h: HandleStruct) -> bool:
    """Whether h is a segmented handle whose segment table is not in the struct."""
    seg = segments_record(h)
    return seg is not None and not seg[3]


def table_in_encoding(h: HandleStruct, enc: bytes, count: int, kind: int, crc: int) -> bytes:
    """The segment table section of a (library-validated) encoding of h."""
    pos = _ENC_FIXED + 16 * h.ndim + h.key_len + 1
    if h.ref_name_len:
        pos += h.ref_name_len + 8
    if h.flags & HANDLE_FLAG_EVENT:
        pos += 64
    pos += 1 + h.ext_len
    end = len(enc) - 4  # the CRC-32 of everything before it
    while pos + 8 <= end:
        stype = int.from_bytes(enc[pos:pos + 2], "little")
        n = int.from_bytes(enc[pos + 4:pos + 8], "little")
        data = enc[pos + 8:pos + 8 + n]
        if stype == EXT_SEGMENTS:
            if len(data) == count * SEGMENT_KINDS[kind][1] and zlib.crc32(data) == crc:
                return data
            break
        pos += 8 + n
    raise Error(Status.INTERNAL, "devshare package: the segment table section was not found in "
                                 "the handle's encoding (please report this)")
