"""Every ctypes mirror of devshare.h (the package's and the GPU suite's) equals the C layout.

tests/c/abi_fields.h is the one list of the ABI (every struct and field, macro and status code)
behind both C layout printers, tests/c/layout_dump.c and `gpu_tool layout`. Here its text must name
exactly what include/devshare.h has; layout_dump.c is compiled against include/ with the system C
compiler and prints what C makes of the list (sizeof, alignment, offset and size of every field,
every macro's and status code's value); abi_check also parses the header's text for the field
names and declared types, and the function prototypes. See abi_check.py for what is compared.
The compiled checks are skipped only when there is no C compiler at all.
"""

from __future__ import annotations

import ctypes
import importlib.util
import pathlib
import pkgutil
import re
import shutil
from ctypes import POINTER, Structure, c_char, c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_void_p

import pytest

import abi_check
import devshare
from devshare import _abi, _lib

ROOT = abi_check.ROOT
GPU_CASES = ROOT / "tests" / "gpu" / "gpu_cases.py"


@pytest.fixture(scope="module")
def header():
    return abi_check.load_header()


@pytest.fixture(scope="module")
def field_list():
    return abi_check.load_field_list()


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    cc = abi_check.find_cc()
    if cc is None:
        pytest.skip("no C compiler (cc, gcc or clang; or $CC) to compile tests/c/layout_dump.c")
    return abi_check.run_dump(tmp_path_factory.mktemp("layout"), cc)


@pytest.fixture(scope="module")
def checker(header, dump):
    return abi_check.Checker(header, dump)


@pytest.fixture(scope="module")
def gpu_cases():
    """tests/gpu/gpu_cases.py, imported by path (it must import without a GPU or torch)."""
    spec = importlib.util.spec_from_file_location("devshare_gpu_cases", GPU_CASES)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _report(problems):
    return "\n  " + "\n  ".join(problems)


# --- The three views agree -------------------------------------------------------------------------


def test_header_parses_and_dump_runs(header, dump):
    assert header.structs, "no structs parsed from devshare.h"
    assert {"DevshareHandle", "DevshareTensorDesc"} <= set(header.structs)
    assert dump.structs["DevshareHandle"].size == dump.macros["DEVSHARE_HANDLE_SIZE"] == 616


def test_field_list_covers_the_header(header, field_list):
    """tests/c/abi_fields.h names every struct, field (in order), macro and status code of the
    header, and nothing else (no C compiler needed)."""
    problems = abi_check.check_list_complete(header, field_list)
    assert not problems, _report(problems)


def test_layout_dump_covers_the_header(header, dump):
    problems = abi_check.check_dump_complete(header, dump)
    assert not problems, _report(problems)


def test_layout_dump_prints_the_field_list(field_list, dump):
    problems = abi_check.check_dump_is_list(field_list, dump)
    assert not problems, _report(problems)


def test_package_mirrors_match_c(checker):
    problems = checker.mirrors_problems(_abi.STRUCTS, complete=True)
    assert not problems, _report(problems)


def test_package_defines_no_other_struct_mirrors():
    """Every ctypes struct with fields in the package is one of the checked mirrors in _abi."""
    names = sorted(m.name for m in pkgutil.iter_modules(devshare.__path__)
                   if m.name.startswith("_") and not m.name.startswith("__"))
    assert {"_abi", "_lib", "_api", "_channel", "_handle", "_registry", "_torch_ipc"} <= set(names)

    known = set(_abi.STRUCTS.values())
    stray = []
    for name in names:
        mod = importlib.import_module(f"devshare.{name}")
        stray += [f"devshare.{name}.{k}" for k, v in abi_check.structs_in(mod).items() if v not in known]
    assert not stray, f"ctypes structs outside devshare._abi.STRUCTS (unchecked): {stray}"


def test_gpu_suite_mirrors_match_c(checker, gpu_cases):
    """tests/gpu/gpu_cases.py uses the package's mirrors (loaded from python/devshare/_abi.py), and
    whatever ctypes structs it holds match C."""
    by_name = {cls.__name__: cname for cname, cls in _abi.STRUCTS.items()}
    mirrors, unknown = {}, []
    for attr, cls in abi_check.structs_in(gpu_cases).items():
        if cls.__name__ in by_name:
            mirrors[by_name[cls.__name__]] = cls
        else:
            unknown.append(attr)
    assert not unknown, (f"gpu_cases.py defines ctypes structs abi_check cannot match to a C struct: "
                         f"{unknown}; use the mirrors of python/devshare/_abi.py")
    assert {"DevshareHandle", "DevshareTorchArgs", "DevshareBackendInfo"} <= set(mirrors)
    own = [a for a, c in abi_check.structs_in(gpu_cases).items() if c.__module__ == gpu_cases.__name__]
    assert not own, f"gpu_cases.py defines its own struct copies {own}: import them from _abi.py"
    problems = checker.mirrors_problems(mirrors, complete=False)
    assert not problems, _report(problems)


def test_constants_match_c(dump):
    """Every constant _abi mirrors (C_MACROS), every status code, and the ABI version it targets,
    against the C compiler's values (the dump prints every macro of the header)."""
    problems = abi_check.constant_problems(_abi, dump)
    assert not problems, _report(problems)


def test_status_codes_match_c(header, dump):
    py = {"DEVSHARE_STATUS_" + s.name: int(s) for s in _abi.Status}
    assert py == header.statuses == dump.statuses


def test_function_signatures_match_c(checker, header):
    problems = []
    for name, restype, argtypes in _lib._SIGNATURES:
        problems += checker.function_problems(name, restype, argtypes)
    assert not problems, _report(problems)
    # Every struct that has an init function is made through it (INIT_FUNCTIONS), and every
    # struct that starts with struct_size has one.
    inits = abi_check.init_functions(header)
    py_inits = {cname: _abi.INIT_FUNCTIONS.get(cls) for cname, cls in _abi.STRUCTS.items()}
    assert {c: f for c, f in py_inits.items() if f} == inits
    versioned = {c for c, fields in header.structs.items() if fields[0][0] == "struct_size"}
    assert versioned <= set(inits), f"versioned structs without an init function: {versioned - set(inits)}"


def test_gpu_suite_signatures_match_c(checker, gpu_cases):
    lib = gpu_cases.Lib(devshare.library_path)
    bound = {k: v for k, v in vars(lib.d).items() if k.startswith("devshare_")}
    assert "devshare_handle_from_torch" in bound and "devshare_probe" in bound
    problems = []
    for name, fn in bound.items():
        problems += checker.function_problems(name, fn.restype, fn.argtypes)
    assert not problems, _report(problems)


# --- struct_size and the init functions ----------------------------------------------------------


def test_new_struct_runs_the_init_function():
    for cls, fn in _abi.INIT_FUNCTIONS.items():
        s = _lib.new_struct(cls)
        assert s.struct_size == ctypes.sizeof(cls), fn
    desc = _lib.new_struct(_abi.TensorDesc, ndim=2)
    assert desc.storage_size == _abi.STORAGE_TO_END and desc.ndim == 2  # the C defaults, then ours
    assert _lib.new_struct(_abi.ImportOptions).device == _abi.DEVICE_FROM_HANDLE
    with pytest.raises(TypeError, match="no field 'nope'"):
        _lib.new_struct(_abi.TensorDesc, nope=1)


def _direct_constructions(path: pathlib.Path, names) -> list[str]:
    text = path.read_text()
    return [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
            for m in re.finditer(r"(?<![\w.])(" + "|".join(names) + r")\(", text)]


def test_versioned_structs_are_only_made_by_their_init_function():
    """No call site builds a versioned struct with its ctypes constructor (which leaves struct_size
    0 or sets it by hand): the package uses _lib.new_struct, gpu_cases.py its init helper."""
    names = [cls.__name__ for cls in _abi.INIT_FUNCTIONS]
    found = []
    for path in sorted((ROOT / "python" / "devshare").glob("*.py")):
        if path.name != "_abi.py":
            found += _direct_constructions(path, names)
    found += _direct_constructions(GPU_CASES, names + ["Handle"])
    assert not found, "versioned structs built without their init function:" + _report(found)


# --- The checker itself rejects drift ----------------------------------------------------------------


def _mirror(name, fields, base=Structure):
    return type(name, (base,), {"_fields_": fields})


def _fields_of(cls):
    return list(cls._fields_)


def test_checker_rejects_a_mirror_without_a_field(checker):
    """The original bug: a DevshareTensorDesc mirror without `stream` (8 bytes short)."""
    broken = _mirror("TensorDesc", [f for f in _fields_of(_abi.TensorDesc) if f[0] != "stream"])
    problems = checker.struct_problems("DevshareTensorDesc", broken)
    assert any("'stream' is missing" in p for p in problems), problems
    assert any("sizeof is 64 in C, 56 in ctypes" in p for p in problems), problems


def test_checker_rejects_an_extra_field(checker):
    broken = _mirror("BackendInfo", _fields_of(_abi.BackendInfo) + [("extra", c_uint32)])
    problems = checker.struct_problems("DevshareBackendInfo", broken)
    assert any("'extra', which the C struct lacks" in p for p in problems), problems


def test_checker_rejects_same_size_drift(checker):
    """Changes that keep sizeof: a renamed field, swapped fields, signedness, pointer vs integer,
    an array of another element type, a nested struct that drifted."""
    f = _fields_of(_abi.ImportOptions)
    renamed = _mirror("O1", [("dev" if n == "device" else n, t) for n, t in f])
    assert any("'device' is missing" in p for p in checker.struct_problems("DevshareImportOptions", renamed))
    swapped = _mirror("O2", [f[0], f[2], f[1]] + f[3:])
    assert any("order differs" in p for p in checker.struct_problems("DevshareImportOptions", swapped))
    unsigned = _mirror("O3", [(n, c_uint32 if n == "device" else t) for n, t in f])
    assert any("'device': C int32_t but ctypes c_uint" in p
               for p in checker.struct_problems("DevshareImportOptions", unsigned))
    integer = _mirror("O4", [(n, c_int64 if n == "stream" else t) for n, t in f])
    assert any("'stream': C void *" in p for p in checker.struct_problems("DevshareImportOptions", integer))
    h = _fields_of(_abi.BackendInfo)
    chars = _mirror("B1", [(n, c_uint8 * 16 if n == "name" else t) for n, t in h])
    assert any("'name': C char[16]" in p for p in checker.struct_problems("DevshareBackendInfo", chars))
    bad_dtype = _mirror("DType", [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint8 * 2)])
    t = _mirror("T1", [(n, bad_dtype if n == "dtype" else tp) for n, tp in _fields_of(_abi.TorchArgs)])
    assert any("'dtype'" in p and "'lanes'" in p for p in checker.struct_problems("DevshareTorchArgs", t))
    ptr = _mirror("T2", [(n, POINTER(c_int32) if n == "shape" else tp) for n, tp in _fields_of(_abi.TorchArgs)])
    assert any("'shape': C int64_t *" in p for p in checker.struct_problems("DevshareTorchArgs", ptr))


def test_checker_requires_every_struct(checker):
    partial = {k: v for k, v in _abi.STRUCTS.items() if k != "DevshareImportInfo"}
    assert "struct DevshareImportInfo has no ctypes mirror" in checker.mirrors_problems(partial, complete=True)


def _dump_with(tmp_path, fields_text=None, header_text=None):
    """layout_dump built from a copy of tests/c/abi_fields.h (or `fields_text`) against a copy of
    include/devshare.h (or `header_text`), as a colleague's edit would leave them."""
    cc = abi_check.find_cc()
    if cc is None:
        pytest.skip("no C compiler (cc, gcc or clang; or $CC) to compile tests/c/layout_dump.c")
    src, inc = tmp_path / "c", tmp_path / "include"
    src.mkdir()
    inc.mkdir()
    shutil.copy(abi_check.DUMP_SOURCE, src / "layout_dump.c")
    (src / "abi_fields.h").write_text(fields_text or abi_check.FIELD_LIST.read_text())
    (inc / "devshare.h").write_text(header_text or abi_check.HEADER.read_text())
    return abi_check.run_dump(tmp_path, cc, source=src / "layout_dump.c", include=inc)


def test_a_field_missing_from_the_list_fails(tmp_path, header):
    """A FIELD line dropped from tests/c/abi_fields.h fails the list check with what to add where,
    and the dump built from that list fails the header and mirror comparisons."""
    text = abi_check.FIELD_LIST.read_text()
    dropped = re.sub(r"^[ \t]*FIELD\(DevshareTensorDesc, stream\)[ \t]*\\\n", "", text, count=1, flags=re.M)
    assert dropped != text
    assert abi_check.check_list_complete(header, abi_check.parse_field_list(dropped)) == [
        "DevshareTensorDesc: field 'stream' is in devshare.h but not in tests/c/abi_fields.h "
        "(add FIELD(DevshareTensorDesc, stream) after FIELD(DevshareTensorDesc, tensor_offset))"]
    dump = _dump_with(tmp_path, fields_text=dropped)
    assert any("only in the header: ['stream']" in p for p in abi_check.check_dump_complete(header, dump))
    problems = abi_check.Checker(header, dump).struct_problems("DevshareTensorDesc", _abi.TensorDesc)
    assert any("'stream' is not in the layout dump" in p for p in problems), problems
    # ... and a struct, a macro or a status code dropped from the list, too.
    for entry, message in (
            ("STATUS(DEVSHARE_STATUS_CLOSED)", "status code DEVSHARE_STATUS_CLOSED is in devshare.h but not in"),
            ("MACRO(DEVSHARE_MAX_NDIM)", "macro DEVSHARE_MAX_NDIM is in devshare.h but not in")):
        less = re.sub(rf"^[ \t]*{re.escape(entry)}[ \t]*\\\n", "", text, count=1, flags=re.M)
        assert less != text, entry
        problems = abi_check.check_list_complete(header, abi_check.parse_field_list(less))
        assert len(problems) == 1 and problems[0].startswith(message), problems
    no_peer = re.sub(r"^[ \t]*(STRUCT|FIELD)\(DevsharePeerInfo\b[^\n]*\n", "", text, flags=re.M)
    assert any(p.startswith("struct DevsharePeerInfo is in devshare.h but not in")
               for p in abi_check.check_list_complete(header, abi_check.parse_field_list(no_peer)))


def test_the_list_parser_refuses_what_it_does_not_understand():
    text = abi_check.FIELD_LIST.read_text()
    entry = "    FIELD(DevshareDType, code)"
    moved = text.replace(entry, "    FIELD(DevshareTensorDesc, code)", 1)
    twice = text.replace(entry, entry + " \\\n" + entry, 1)
    odd = text.replace(entry, entry + "; FIELD(DevshareDType, x)", 1)
    for bad, why in ((moved, "not under STRUCT(DevshareTensorDesc)"), (twice, "twice"), (odd, "not understood"),
                     (text.replace("#define ABI_STATUSES(STATUS)", "#define ABI_STATUS_LIST(STATUS)"),
                      "ABI_STATUSES(...) not found")):
        assert bad != text, why
        with pytest.raises(abi_check.ParseError, match=re.escape(why)):
            abi_check.parse_field_list(bad)


def test_a_field_added_to_the_header_only_fails(tmp_path, dump, field_list):
    """A field added to devshare.h (as a colleague would, by regenerating it) but neither to the
    list nor to the mirror fails every comparison: the list's, the dump's (built against that
    header) and the mirror's."""
    text = abi_check.HEADER.read_text()
    text2 = re.sub(r"(typedef struct DevshareTensorDesc \{\n)", r"\1  uint32_t added_later;\n", text)
    assert text2 != text
    header2 = abi_check.parse_header(text2)
    assert abi_check.check_list_complete(header2, field_list) == [
        "DevshareTensorDesc: field 'added_later' is in devshare.h but not in tests/c/abi_fields.h "
        "(add FIELD(DevshareTensorDesc, added_later) right after STRUCT(DevshareTensorDesc))"]
    dump2 = _dump_with(tmp_path, header_text=text2)
    assert any("only in the header: ['added_later']" in p for p in abi_check.check_dump_complete(header2, dump2))
    problems = abi_check.Checker(header2, dump2).struct_problems("DevshareTensorDesc", _abi.TensorDesc)
    assert any("'added_later' is missing from the mirror" in p for p in problems), problems
    assert any("sizeof is 72 in C, 64 in ctypes" in p for p in problems), problems
    # ... and a new struct, status code or macro, too.
    text3 = text.replace("#ifdef __cplusplus\nextern",
                         "typedef struct DevshareNew {\n  uint32_t struct_size;\n} DevshareNew;\n\n"
                         "#ifdef __cplusplus\nextern", 1)
    header3 = abi_check.parse_header(text3)
    assert "struct DevshareNew is in devshare.h but not in the layout dump" in " ".join(
        abi_check.check_dump_complete(header3, dump))
    assert any(p.startswith("struct DevshareNew is in devshare.h but not in tests/c/abi_fields.h")
               for p in abi_check.check_list_complete(header3, field_list))
    text4 = text.replace("DEVSHARE_STATUS_OK = 0,", "DEVSHARE_STATUS_OK = 0,\n  DEVSHARE_STATUS_NEW = -4,")
    header4 = abi_check.parse_header(text4)
    assert any("status codes differ" in p for p in abi_check.check_dump_complete(header4, dump))
    assert any(p.startswith("status code DEVSHARE_STATUS_NEW is in devshare.h but not in")
               for p in abi_check.check_list_complete(header4, field_list))
    text5 = text.replace("#define DEVSHARE_MAX_NDIM 8\n", "#define DEVSHARE_MAX_NDIM 8\n#define DEVSHARE_NEW_LIMIT 9\n")
    header5 = abi_check.parse_header(text5)
    assert "macro DEVSHARE_NEW_LIMIT is in devshare.h but not in the layout dump" in " ".join(
        abi_check.check_dump_complete(header5, dump))
    assert any(p.startswith("macro DEVSHARE_NEW_LIMIT is in devshare.h but not in")
               for p in abi_check.check_list_complete(header5, field_list))


def test_parser_refuses_what_it_does_not_understand():
    for body in ("uint32_t a : 3;", "uint32_t a, b;", "void (*fn)(int);", "union { int a; } u;"):
        with pytest.raises(abi_check.ParseError):
            abi_check.parse_header("enum DevshareStatus { DEVSHARE_STATUS_OK = 0, };\n"
                                   f"typedef struct S {{\n  {body}\n}} S;\n")
    name, ct = abi_check.parse_decl("const struct DevshareDType *const *x[4][2]")
    assert name == "x" and ct == abi_check.CType("DevshareDType", 2, ("4", "2"), True)


def test_checker_type_rules(checker):
    ct = abi_check.CType
    assert checker.type_problem(ct("char", 1), ctypes.c_char_p) is None
    assert checker.type_problem(ct("uint8_t", 1), POINTER(c_uint8)) is None
    assert checker.type_problem(ct("uint8_t", 1), POINTER(c_uint16)) is not None
    assert checker.type_problem(ct("void", 2), POINTER(c_void_p)) is None
    assert checker.type_problem(ct("uint16_t"), c_uint16) is None
    assert checker.type_problem(ct("uint16_t"), ctypes.c_int16) is not None
    assert checker.type_problem(ct("char", 0, ("16",)), c_char * 16) is None
    assert checker.type_problem(ct("char", 0, ("16",)), c_char * 15) is not None
    assert checker.type_problem(ct("void"), None) is None
    assert checker.type_problem(ct("DevshareExporter", 1, (), True), POINTER(_lib.Exporter)) is None
