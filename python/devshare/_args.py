"""Checks of the arguments the public functions share: shapes, timeouts, and a value's type as
error messages name it.

One job: turn what a caller passed into what the library takes, or raise TypeError /
ValueError naming the problem. Imports only :mod:`devshare._ints` (and the standard library).
"""

from __future__ import annotations

import math
import numbers

from . import _ints

#: The longest finite wait ``devshare_exporter_wait`` takes (int64 milliseconds).
MAX_WAIT_MS = (1 << 63) - 1
_FAST_SECONDS = MAX_WAIT_MS // 1000  # whole seconds within MAX_WAIT_MS


def type_label(obj) -> str:
    """The type of ``obj`` as error messages name it: ``int``, ``numpy.ndarray``, ..."""
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def timeout_ms(timeout) -> int:
    """A timeout in seconds (int or float; None or math.inf: forever) as devshare_exporter_wait's
    int64 milliseconds (-1: forever), rounded up. TypeError for bool and non-numbers, ValueError
    for NaN, negative values and finite values beyond int64 milliseconds (about 292 million
    years: ctypes would wrap them into a short wait)."""
    if timeout is None:
        return -1
    if type(timeout) is int and 0 <= timeout <= _FAST_SECONDS:  # the usual timeouts, at once
        return timeout * 1000
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds (int or float) or None, not "
                        f"{type_label(timeout)}")
    if isinstance(timeout, numbers.Integral):
        ms = int(timeout) * 1000  # exact for every int
    else:
        t = float(timeout)
        if math.isnan(t):
            raise ValueError("timeout must be a number of seconds, not NaN")
        if t == math.inf:
            return -1
        ms = math.ceil(t * 1000) if t >= 0 else -1
    if ms < 0:
        raise ValueError(f"timeout must be >= 0 seconds (or None to wait forever), not {timeout!r}")
    if ms > MAX_WAIT_MS:
        raise ValueError(f"timeout {timeout!r} s is beyond the longest finite wait "
                         f"({MAX_WAIT_MS // 1000} s); use None (or math.inf) to wait forever")
    return ms


def normalize_shape(shape) -> tuple[int, ...]:
    """shape as a tuple of ints in [0, INT64_MAX]: an int (or integer-like: ``operator.index``)
    or an iterable of them (tuple, list, ``torch.Size``, ...). TypeError for str/bytes (their
    characters are not dimensions), floats, bools and other non-integers; ValueError for
    negative or oversized dimensions."""
    if isinstance(shape, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"shape must be an int or a sequence of ints, not {type_label(shape)}")
    if isinstance(shape, bool):
        raise TypeError("shape must be an int or a sequence of ints, not bool")
    try:
        return (_ints.index("shape", shape, *_ints.N64),)
    except TypeError:
        pass
    except ValueError:
        raise ValueError(f"negative or oversized dimension in shape {shape!r} (each must be in "
                         f"[0, {_ints.N64[1]}])") from None
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints, not {type_label(shape)}") from None
    out = []
    for i, d in enumerate(dims):
        try:
            out.append(_ints.index(f"shape[{i}]", d, *_ints.N64))
        except TypeError:
            raise TypeError(f"shape[{i}] must be an int, not {type_label(d)} (shape {shape!r})") from None
        except ValueError:
            raise ValueError(f"negative or oversized dimension {d} in shape {shape!r} (each must be "
                             f"in [0, {_ints.N64[1]}])") from None
    return tuple(out)
