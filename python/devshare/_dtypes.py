"""Element types: DLPack (code, bits, lanes) <-> torch and numpy dtypes.

torch and numpy are imported lazily, so either can be absent.

Imports only :mod:`devshare._ints`.
"""

from __future__ import annotations

from ._ints import U8, U16, index

INT, UINT, FLOAT, OPAQUE, BFLOAT, COMPLEX, BOOL = 0, 1, 2, 3, 4, 5, 6
# DLPack's float8 codes.
FLOAT8 = {
    "float8_e3m4": 7,
    "float8_e4m3": 8,
    "float8_e4m3b11fnuz": 9,
    "float8_e4m3fn": 10,
    "float8_e4m3fnuz": 11,
    "float8_e5m2": 12,
    "float8_e5m2fnuz": 13,
    "float8_e8m0fnu": 14,
}

# Type name (as torch and numpy spell it) -> (code, bits, lanes).
_BY_NAME = {
    "bool": (BOOL, 8, 1),
    "uint8": (UINT, 8, 1),
    "uint16": (UINT, 16, 1),
    "uint32": (UINT, 32, 1),
    "uint64": (UINT, 64, 1),
    "int8": (INT, 8, 1),
    "int16": (INT, 16, 1),
    "int32": (INT, 32, 1),
    "int64": (INT, 64, 1),
    "float16": (FLOAT, 16, 1),
    "float32": (FLOAT, 32, 1),
    "float64": (FLOAT, 64, 1),
    "bfloat16": (BFLOAT, 16, 1),
    "complex64": (COMPLEX, 64, 1),
    "complex128": (COMPLEX, 128, 1),
}
_BY_NAME.update({name: (code, 8, 1) for name, code in FLOAT8.items()})
_BY_CODE = {v: k for k, v in _BY_NAME.items()}

# Types numpy has no dtype for.
_NOT_IN_NUMPY = {"bfloat16", *FLOAT8}


def torch_module():
    """torch if it is importable (imported on first use), else None. Always through ``import``,
    which waits while another thread is still importing it (``sys.modules`` holds the module
    half-initialised meanwhile)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def numpy_module():
    """numpy if it is importable (imported on first use), else None (as :func:`torch_module`)."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def require_torch():
    torch = torch_module()
    if torch is None:
        raise ImportError("this needs PyTorch (import torch failed); use like='numpy' without it")
    return torch


def require_numpy():
    numpy = numpy_module()
    if numpy is None:
        raise ImportError("this needs numpy (import numpy failed)")
    return numpy


def type_name(code: int, bits: int, lanes: int) -> str:
    """torch/numpy spelling of a DLPack type, or a ValueError naming it."""
    try:
        return _BY_CODE[(code, bits, lanes)]
    except KeyError:
        raise ValueError(f"DLPack type (code={code}, bits={bits}, lanes={lanes}) has no torch or "
                         f"numpy equivalent") from None


def to_torch(code: int, bits: int, lanes: int):
    torch = require_torch()
    name = type_name(code, bits, lanes)
    dt = getattr(torch, name, None)
    if dt is None:
        raise ValueError(f"this PyTorch has no torch.{name}")
    return dt


def to_numpy(code: int, bits: int, lanes: int):
    numpy = require_numpy()
    name = type_name(code, bits, lanes)
    if name in _NOT_IN_NUMPY:
        raise TypeError(f"{name} has no numpy dtype: open it with like='torch' (or view its bytes "
                        f"as uint8/uint16)")
    return numpy.dtype(name)


def _torch_dtype_name(dt) -> str | None:
    s = str(dt)
    return s[len("torch."):] if s.startswith("torch.") else None


def from_any(dtype) -> tuple[int, int, int]:
    """(code, bits, lanes) of a torch dtype, numpy dtype(-like), a name such as "bfloat16" or a
    DLPack ``(code, bits, lanes)`` tuple of ints (TypeError for other types, ValueError when a
    field does not fit its C type)."""
    if isinstance(dtype, tuple) and len(dtype) == 3:
        # DLPack (code, bits, lanes): checked like every integer bound for the library.
        return (index("dtype code", dtype[0], *U8), index("dtype bits", dtype[1], *U8),
                index("dtype lanes", dtype[2], *U16))
    name = None
    if isinstance(dtype, str):
        name = dtype[len("torch."):] if dtype.startswith("torch.") else dtype
        if name not in _BY_NAME:
            numpy = numpy_module()
            if numpy is not None:
                try:
                    name = numpy.dtype(dtype).name
                except (TypeError, ValueError):
                    pass
    elif type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":
        name = _torch_dtype_name(dtype)
    else:
        numpy = numpy_module()
        if numpy is not None:
            try:
                nd = numpy.dtype(dtype)
            except (TypeError, ValueError):
                nd = None
            if nd is not None and nd.byteorder not in (">",) and nd.fields is None:
                name = nd.name
    if name in _BY_NAME:
        return _BY_NAME[name]
    raise TypeError(f"unsupported dtype {dtype!r} (supported: {', '.join(sorted(_BY_NAME))})")
