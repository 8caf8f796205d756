"""One libdevshare per process: Python's devshare and a C++ component built against the wheel's
CMake package, loaded into this same process with ctypes.CDLL, use the same library.

    python one_library.py path/to/libsame_registry.so
"""

import ctypes
import os
import sys

import torch

import devshare
from devshare import _lib


def libdevshare_mappings() -> set:
    """(device, inode) of every file mapped into this process whose name contains libdevshare."""
    files = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and "libdevshare" in os.path.basename(parts[5]):
                files.add((parts[3], parts[4], parts[5]))
    return {(dev, inode) for dev, inode, _ in files}, sorted({p for _, _, p in files})


def main(component: str) -> None:
    assert os.path.realpath(devshare.library_path) == os.path.realpath(devshare.get_library())
    comp = ctypes.CDLL(component)
    comp.same_registry_version_fn.restype = ctypes.c_void_p
    comp.same_registry_library_file.restype = ctypes.c_char_p
    comp.same_registry_import.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p),
                                          ctypes.POINTER(ctypes.c_float)]
    comp.same_registry_import.restype = ctypes.c_int32
    comp.same_registry_release.argtypes = [ctypes.c_void_p]
    comp.same_registry_release.restype = ctypes.c_int32

    # 1. The same function: the C++ component's devshare_version is Python's.
    py_fn = ctypes.cast(_lib.lib.devshare_version, ctypes.c_void_p).value
    c_fn = comp.same_registry_version_fn()
    assert py_fn == c_fn, (hex(py_fn), hex(c_fn))
    # 2. From the same file (dladdr), the wheel's.
    c_file = comp.same_registry_library_file().decode()
    assert os.path.realpath(c_file) == os.path.realpath(devshare.library_path), (c_file, devshare.library_path)
    # 3. Exactly one libdevshare file mapped into the process.
    inodes, paths = libdevshare_mappings()
    assert len(inodes) == 1, paths
    # 4. The same import registry: a tensor shared by Python and imported by the C++ component is
    #    one reference of Python's exporter, and comes back when the component releases it.
    x = torch.full((16,), 7.5)
    h = devshare.share(x)
    imp = ctypes.c_void_p()
    first = ctypes.c_float()
    s = comp.same_registry_import(h.to_text().encode(), ctypes.byref(imp), ctypes.byref(first))
    assert s == 0, s
    assert first.value == 7.5
    assert devshare.outstanding(x) == 1
    assert comp.same_registry_release(imp) == 0
    assert devshare.wait(x, timeout=10) and devshare.outstanding(x) == 0
    print(f"ok: one libdevshare in this process ({paths[0]}), shared by Python and {os.path.basename(component)}")


if __name__ == "__main__":
    main(sys.argv[1])
