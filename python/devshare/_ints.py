"""Integers on their way into ctypes: checked, never wrapped.

ctypes converts a Python int to a C integer by silently keeping its low bits (``c_uint64`` of
``2**64 + 4096`` is 4096, ``c_int32`` of ``2**32 + 5`` is 5), in function arguments, struct
fields and arrays alike. So every integer this package passes to the library goes through
:func:`index` (explicit checks with a message naming the argument) and, as a backstop,
:func:`check_args` / :func:`check_fields` (every integer argument of every library call and
every integer field of every struct the package fills, against the C type's range).

The rules (docs/python.md states them):

- an integer argument takes ``int`` or anything ``operator.index`` accepts (numpy and torch
  integer scalars); ``bool`` is refused (``True`` as a size, pid or timeout is a bug, not a 1),
  and so are ``float``, ``str``, ``bytes`` and everything else: :class:`TypeError`;
- a value outside what the C field holds (or what the argument allows) is a :class:`ValueError`
  naming the argument, the value and the range, raised before anything reaches the library.

Imports no module of the package (it is in the bottom layer: every module above may use it).
"""

from __future__ import annotations

import ctypes
import operator

U8 = (0, (1 << 8) - 1)
U16 = (0, (1 << 16) - 1)
U32 = (0, (1 << 32) - 1)
U64 = (0, (1 << 64) - 1)
I32 = (-(1 << 31), (1 << 31) - 1)
I64 = (-(1 << 63), (1 << 63) - 1)
#: Non-negative int64: sizes, shape entries, offsets.
N64 = (0, (1 << 63) - 1)


def _type_name(value) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def index(name: str, value, lo: int, hi: int) -> int:
    """``value`` as an int in ``[lo, hi]``: TypeError for bool and non-integers (floats, str,
    bytes, ...), ValueError naming ``name`` when it is out of range."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, not {_type_name(value)}") from None
    if not lo <= v <= hi:
        raise ValueError(f"{name} {v} is out of range [{lo}, {hi}]")
    return v


def int64_array(name: str, values):
    """A ``c_int64`` array of ``values`` (each checked: ``name[i]`` in int64), at least 1 long."""
    vals = [index(f"{name}[{i}]", v, *I64) for i, v in enumerate(values)]
    return (ctypes.c_int64 * max(len(vals), 1))(*vals)


# --- the backstop: ranges of the C integer types --------------------------------------------------

_INT_TYPES = (ctypes.c_int8, ctypes.c_int16, ctypes.c_int32, ctypes.c_int64, ctypes.c_long,
              ctypes.c_longlong, ctypes.c_int, ctypes.c_short, ctypes.c_byte,
              ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_ulong,
              ctypes.c_ulonglong, ctypes.c_uint, ctypes.c_ushort, ctypes.c_ubyte, ctypes.c_size_t,
              ctypes.c_ssize_t)
_RANGES: dict[type, tuple[int, int]] = {}
for _t in _INT_TYPES:
    _bits = 8 * ctypes.sizeof(_t)
    _RANGES[_t] = (-(1 << (_bits - 1)), (1 << (_bits - 1)) - 1) if _t(-1).value < 0 else (0, (1 << _bits) - 1)
del _t, _bits


def ctype_range(ctype) -> tuple[int, int] | None:
    """(lo, hi) of a ctypes integer type, None for any other type."""
    return _RANGES.get(ctype)


def _check(what: str, ctype, value) -> None:
    rng = _RANGES.get(ctype)
    if rng is None or isinstance(value, ctypes._SimpleCData):
        return
    if isinstance(value, bool):
        return  # flags given as True/False by the package itself
    if isinstance(value, float):
        raise TypeError(f"{what} must be an int, not float")
    try:
        v = operator.index(value)
    except TypeError:
        return  # ctypes raises its own TypeError for these
    if not rng[0] <= v <= rng[1]:
        raise ValueError(f"{what} {v} is out of range [{rng[0]}, {rng[1]}] of its C type")


def check_args(fn, args) -> None:
    """Range-check the integer arguments of a library call against ``fn.argtypes``."""
    argtypes = getattr(fn, "argtypes", None) or ()
    for i, (ctype, value) in enumerate(zip(argtypes, args)):
        rng = _RANGES.get(ctype)
        # The common case (an int in range, or a ctypes object) without building a message.
        if rng is None or isinstance(value, ctypes._SimpleCData):
            continue
        if type(value) is int and rng[0] <= value <= rng[1]:
            continue
        _check(f"argument {i + 1} of {getattr(fn, '__name__', 'the call')}", ctype, value)


def check_fields(cls, fields: dict) -> None:
    """Range-check integer ``fields`` (name -> value) of a ctypes struct class."""
    types = dict((f[0], f[1]) for f in cls._fields_)
    for name, value in fields.items():
        ctype = types.get(name)
        if ctype in _RANGES:
            _check(f"{cls.__name__}.{name}", ctype, value)
