"""What a stock PyTorch consumer makes of a CUDA storage handle (arg 7 of ``reduce_tensor``),
written from PyTorch's reader rules (c10/cuda/CUDACachingAllocator.cpp) so tests can check the
bytes devshare writes for each torch version without that version installed:

- a raw 64-byte handle is a ``cudaMalloc`` handle for every version;
- otherwise ``[version][type]``: a version above the reader's own is refused ("received sharable
  handle from a future version of torch");
- 'e': the reader applies *its own* header, whatever the version byte says — 24 bytes up to 2.12
  (``{i32 pid; 4 pad; u64 segment_size; u64 n}``, records fds unless its own settings say fabric),
  32 bytes from 2.13 (``{...; i32 handle_type; 4 pad}``, 1 fd, 2 fabric, 0 its own setting,
  anything else refused).
"""

from __future__ import annotations

import sys


class TorchRefused(Exception):
    pass


def own_version(torch_version: str) -> int:
    """The handle version a PyTorch release writes and reads up to (2.5-2.12: 2, 2.13+: 3)."""
    major, minor = (int("".join(c for c in p if c.isdigit()) or 0) for p in torch_version.split(".")[:2])
    if (major, minor) < (2, 5):
        return 0
    return 2 if (major, minor) < (2, 13) else 3


def read(own: int, data: bytes, fabric_config: bool = False):
    """("raw", key) / ("c", version, key) / ("e", pid, segment_size, fabric, records), or raises
    TorchRefused with PyTorch's message."""
    if len(data) == 64:
        return ("raw", data)
    version, kind = data[0], data[1:2]
    if version > own:
        raise TorchRefused("received sharable handle from a future version of torch")
    if kind == b"c":
        return ("c", version, data[2:66])
    if kind != b"e":
        raise TorchRefused(f"unknown handle type {kind!r}")
    header = 32 if own >= 3 else 24
    p = data[2:]
    if len(p) < header:
        raise TorchRefused("truncated ShareHeader")
    pid = int.from_bytes(p[0:4], sys.byteorder, signed=True)
    segment_size = int.from_bytes(p[8:16], sys.byteorder)
    n = int.from_bytes(p[16:24], sys.byteorder)
    fabric = fabric_config
    if own >= 3:
        t = int.from_bytes(p[24:28], sys.byteorder, signed=True)
        if t not in (0, 1, 2):
            raise TorchRefused("Unknown Expandable_Segments_Handle_Type in IPC share header")
        fabric = fabric_config if t == 0 else t == 2
    records = p[header:]
    if len(records) != n * (64 if fabric else 4):
        raise TorchRefused(f"{len(records)} record bytes for {n} segments")
    return ("e", pid, segment_size, fabric, records)


def same_segments(a: bytes, b: bytes) -> bool:
    """Two CUDA 'e' handles of any versions name the same segments (pid, segment size, records):
    each read by a reader of its own version, never compared bytewise (padding varies)."""
    ra = read(a[0], a, fabric_config=_looks_fabric(a))
    rb = read(b[0], b, fabric_config=_looks_fabric(b))
    return ra == rb


def _looks_fabric(data: bytes) -> bool:
    header = 32 if data[0] >= 3 else 24
    n = int.from_bytes(data[2 + 16:2 + 24], sys.byteorder)
    return len(data) - 2 - header == 64 * n
