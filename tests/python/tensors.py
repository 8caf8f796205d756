"""Tensor helpers for the tests: element bytes in logical order, fresh values, dtype codes."""

import numpy as np
import torch

# torch dtype -> (DLPack code, bits)
DLPACK = {
    torch.bool: (6, 8),
    torch.uint8: (1, 8),
    torch.int8: (0, 8),
    torch.int16: (0, 16),
    torch.int32: (0, 32),
    torch.int64: (0, 64),
    torch.float16: (2, 16),
    torch.bfloat16: (4, 16),
    torch.float32: (2, 32),
    torch.float64: (2, 64),
    torch.complex64: (5, 64),
    torch.complex128: (5, 128),
}


def logical_bytes(x) -> bytes:
    """Every element's bytes in logical row-major order (torch tensor or numpy array)."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).tobytes()
    return x.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def values(dtype, shape, seed=0) -> torch.Tensor:
    """A contiguous tensor of fresh values (different for different seeds)."""
    g = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.int64).to(torch.uint8)
    if not dtype.is_floating_point and not dtype.is_complex:
        info = torch.iinfo(dtype)
        lo, hi = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)


def csv(xs) -> str:
    return ",".join(str(int(x)) for x in xs)


def info_line(dtype, shape, strides) -> str:
    code, bits = DLPACK[dtype]
    numel = 1
    for d in shape:
        numel *= d
    return (f"info code={code} bits={bits} lanes=1 ndim={len(shape)} shape={csv(shape)} "
            f"strides={csv(strides)} numel={numel}")
