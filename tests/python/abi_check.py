"""Compare ctypes mirrors of devshare's C ABI with include/devshare.h (used by test_abi_layout.py
and by the GPU suite's dry run, tests/gpu/gpu_cases.py).

One list of the ABI drives the C side: ``tests/c/abi_fields.h`` names every struct with every
field in declaration order, every ``DEVSHARE_*`` macro and every status code (X-macros), and its
``abi_layout_print()`` prints what the C compiler makes of them. ``tests/c/layout_dump.c`` and
``gpu_tool layout`` (tests/gpu) are both that printer. Four views of the ABI are compared, so that
none can drift alone:

1. the header's text: the field list (names, order, declared types) of every struct, the status
   codes, the macro names, and the function prototypes (:func:`parse_header`);
2. the list's text (:func:`parse_field_list`): it must name exactly what the header has
   (:func:`check_list_complete`), which needs no C compiler;
3. the C compiler's view: the list's printer compiled against ``include/`` prints sizeof,
   alignment, every field's offset and size, macro values and status values (:func:`run_dump`);
   it must cover exactly the header too (:func:`check_dump_complete`);
4. the ctypes classes (``_fields_``), constants and function signatures (``argtypes``/``restype``):
   :class:`Checker` and :func:`constant_problems`.

A struct, field, macro or status code the header has and the list or the dump lacks (or the other
way round) is a problem, so is any difference between a mirror and the C layout: a field missing
or extra on either side, a different order, offset, size or type kind (signedness, pointer, array
length, nested struct), sizeof or alignment, or a constant's value. Every check returns a list of
problem strings; empty means equal.

Nothing here imports devshare or needs a GPU; only the standard library is used.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import pathlib
import re
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADER = ROOT / "include" / "devshare.h"
FIELD_LIST = ROOT / "tests" / "c" / "abi_fields.h"
DUMP_SOURCE = ROOT / "tests" / "c" / "layout_dump.c"


def _rel(path: pathlib.Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)

# --- 1. The header's text ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CType:
    """A declared C type: ``base`` without qualifiers (``uint32_t``, ``DevshareDType``, ``void``),
    ``ptr`` levels of pointer, ``dims`` array dimensions as written, ``struct``: base is a struct."""

    base: str
    ptr: int = 0
    dims: tuple[str, ...] = ()
    struct: bool = False

    def __str__(self):
        s = ("struct " if self.struct else "") + self.base + " " + "*" * self.ptr
        return s.strip() + "".join(f"[{d}]" for d in self.dims)


@dataclasses.dataclass
class Header:
    structs: dict[str, list[tuple[str, CType]]]  # struct -> [(field, type)] in order
    opaque: set[str]  # typedef struct X X; without a body
    macros: set[str]  # DEVSHARE_* macro names
    statuses: dict[str, int]  # DEVSHARE_STATUS_* -> value (literal in the enum)
    functions: dict[str, tuple[CType, list[CType]]]  # name -> (return type, parameter types)


class ParseError(ValueError):
    pass


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def parse_decl(decl: str) -> tuple[str, CType]:
    """``const int64_t *shape`` -> ("shape", CType("int64_t", 1)). Anything this simple parser
    does not understand (bit-fields, function pointers, several declarators, unnamed
    parameters) is a ParseError, so that a header change cannot slip past the test unnoticed."""
    d = " ".join(decl.replace("*", " * ").split())
    if not d or any(c in d for c in ",:()={}"):
        raise ParseError(f"cannot parse declaration {decl.strip()!r}")
    dm = re.search(r"(?:\s*\[[^\]]+\])+$", d)
    dims: tuple[str, ...] = ()
    if dm:
        dims = tuple(x.strip() for x in re.findall(r"\[([^\]]+)\]", dm.group(0)))
        d = d[: dm.start()].strip()
    tokens = d.split()
    if len(tokens) < 2 or not re.fullmatch(r"[A-Za-z_]\w*", tokens[-1]) or tokens[-1] in (
            "const", "volatile", "struct", "void"):
        raise ParseError(f"cannot parse declaration {decl.strip()!r} (no name?)")
    name, rest = tokens[-1], tokens[:-1]
    ptr = rest.count("*")
    words = [w for w in rest if w not in ("*", "const", "volatile")]
    struct = bool(words) and words[0] == "struct"
    if struct:
        words = words[1:]
    if len(words) != 1 or not re.fullmatch(r"[A-Za-z_]\w*", words[0]):
        raise ParseError(f"cannot parse the type of declaration {decl.strip()!r}")
    return name, CType(words[0], ptr, dims, struct)


def parse_header(text: str) -> Header:
    src = _strip_comments(text)
    src = re.sub(r"^\s*#[^\n]*", "", src, flags=re.M)  # preprocessor lines (macros: see below)
    structs: dict[str, list[tuple[str, CType]]] = {}
    for m in re.finditer(r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", src, re.S):
        tag, body, alias = m.groups()
        if tag != alias:
            raise ParseError(f"struct {tag} is typedef'd as {alias}")
        if re.search(r"\b(struct|union)\s*\{|\{", body):
            raise ParseError(f"struct {tag}: nested or anonymous struct/union bodies are not parsed")
        fields = []
        for decl in body.split(";"):
            if decl.strip():
                name, ct = parse_decl(decl)
                fields.append((name, ct))
        if not fields:
            raise ParseError(f"struct {tag} has no fields")
        structs[tag] = fields
    # Every "typedef struct" must be either parsed above or opaque: nothing is skipped silently.
    opaque = set(re.findall(r"typedef\s+struct\s+(\w+)\s+\1\s*;", src))
    all_typedefs = set(re.findall(r"typedef\s+struct\s+(\w+)", src))
    missed = all_typedefs - set(structs) - opaque
    if missed:
        raise ParseError(f"typedef struct not understood: {sorted(missed)}")
    if re.search(r"\bunion\b", src):
        raise ParseError("the header has a union: teach abi_check.parse_header about it")

    macros = set(re.findall(r"^\s*#\s*define\s+(DEVSHARE_\w+)", text, re.M)) - {"DEVSHARE_H"}

    em = re.search(r"enum\s+DevshareStatus\b[^{]*\{(.*?)\}\s*;", src, re.S)
    if em is None:
        raise ParseError("enum DevshareStatus not found")
    statuses = {}
    for item in em.group(1).split(","):
        item = item.strip()
        if not item:
            continue
        sm = re.fullmatch(r"(DEVSHARE_STATUS_\w+)\s*=\s*(-?\d+)", item)
        if sm is None:
            raise ParseError(f"status enum entry {item!r} not understood")
        statuses[sm.group(1)] = int(sm.group(2))

    functions = {}
    for fm in re.finditer(r"(?<=[;{}])\s*([A-Za-z_][\w\s*]*?)\b(devshare_\w+)\s*\(([^()]*)\)\s*;", src):
        ret, name, params = fm.groups()
        _, rt = parse_decl(ret + " x")
        plist = [] if params.strip() in ("", "void") else [
            parse_decl(p)[1] for p in params.split(",")]
        functions[name] = (rt, plist)
    return Header(structs, opaque, macros, statuses, functions)


def load_header(path: pathlib.Path = HEADER) -> Header:
    return parse_header(path.read_text())


# --- 2. The list's text (tests/c/abi_fields.h) -------------------------------------------------------


@dataclasses.dataclass
class FieldList:
    structs: dict[str, list[str]]  # struct -> its fields, in list order
    macros: list[str]
    statuses: list[str]


def _xmacro_items(text: str, name: str, params: int) -> list[tuple[str, tuple[str, ...]]]:
    """The entries ``WORD(arg, ...)`` of ``#define name(...)`` and its continuation lines."""
    m = re.search(rf"^[ \t]*#[ \t]*define[ \t]+{name}\(([^)]*)\)[ \t]*\\?\n", text, re.M)
    if m is None:
        raise ParseError(f"#define {name}(...) not found")
    macro_params = [p.strip() for p in m.group(1).split(",")]
    if len(macro_params) != params:
        raise ParseError(f"{name} takes {len(macro_params)} parameters, expected {params}")
    items = []
    rest = text[m.end():] if m.group(0).rstrip("\n").endswith("\\") else ""
    for line in rest.splitlines():
        cont = line.rstrip().endswith("\\")
        body = line.rstrip().rstrip("\\").strip()
        if body:
            im = re.fullmatch(r"(\w+)\(\s*(\w+)\s*(?:,\s*(\w+)\s*)?\)", body)
            if im is None or im.group(1) not in macro_params:
                raise ParseError(f"{name}: entry {body!r} not understood (one {' or '.join(macro_params)}(...) "
                                 f"a line)")
            items.append((im.group(1), tuple(a for a in im.groups()[1:] if a is not None)))
        if not cont:
            break
    return items


def parse_field_list(text: str) -> FieldList:
    """The lists of tests/c/abi_fields.h: ABI_STRUCTS(STRUCT, FIELD), ABI_MACROS(MACRO) and
    ABI_STATUSES(STATUS). Anything else in their bodies, a FIELD outside the STRUCT it names, or a
    name listed twice is a ParseError."""
    text = _strip_comments(text)
    structs: dict[str, list[str]] = {}
    current = None
    for kind, args in _xmacro_items(text, "ABI_STRUCTS", 2):
        if kind == "STRUCT" and len(args) == 1:
            if args[0] in structs:
                raise ParseError(f"ABI_STRUCTS lists STRUCT({args[0]}) twice")
            current = args[0]
            structs[current] = []
        elif kind == "FIELD" and len(args) == 2:
            if args[0] != current:
                raise ParseError(f"ABI_STRUCTS: FIELD({args[0]}, {args[1]}) is not under STRUCT({args[0]})"
                                 f"{f' (it follows STRUCT({current}))' if current else ''}")
            if args[1] in structs[current]:
                raise ParseError(f"ABI_STRUCTS lists FIELD({args[0]}, {args[1]}) twice")
            structs[current].append(args[1])
        else:
            raise ParseError(f"ABI_STRUCTS: {kind}{args} has the wrong number of arguments")
    lists = []
    for name, kind in (("ABI_MACROS", "MACRO"), ("ABI_STATUSES", "STATUS")):
        names = []
        for k, args in _xmacro_items(text, name, 1):
            if len(args) != 1:
                raise ParseError(f"{name}: {k}{args} has the wrong number of arguments")
            if args[0] in names:
                raise ParseError(f"{name} lists {k}({args[0]}) twice")
            names.append(args[0])
        lists.append(names)
    return FieldList(structs, lists[0], lists[1])


def load_field_list(path: pathlib.Path = FIELD_LIST) -> FieldList:
    return parse_field_list(path.read_text())


def check_list_complete(header: Header, flist: FieldList, where: pathlib.Path = FIELD_LIST) -> list[str]:
    """The list names exactly the header's structs, fields (in declaration order), macros and
    status codes. Each problem says what to change in the list."""
    bad = []
    src = _rel(where)
    for s in header.structs:
        if s not in flist.structs:
            bad.append(f"struct {s} is in devshare.h but not in {src} (add STRUCT({s}) and its FIELD lines "
                       f"to ABI_STRUCTS)")
    for s in flist.structs:
        if s not in header.structs:
            bad.append(f"struct {s} is in {src} but not in devshare.h (remove it from ABI_STRUCTS)")
    for s in [s for s in header.structs if s in flist.structs]:
        h = [f for f, _ in header.structs[s]]
        listed = flist.structs[s]
        for i, f in enumerate(h):
            if f not in listed:
                after = f"after FIELD({s}, {h[i - 1]})" if i else f"right after STRUCT({s})"
                bad.append(f"{s}: field {f!r} is in devshare.h but not in {src} (add FIELD({s}, {f}) {after})")
        for f in listed:
            if f not in h:
                bad.append(f"{s}: field {f!r} is in {src} but not in devshare.h (remove FIELD({s}, {f}))")
        common_h = [f for f in h if f in listed]
        common_l = [f for f in listed if f in h]
        if common_h != common_l:
            bad.append(f"{s}: {src} lists the fields in another order than devshare.h: {common_l}, "
                       f"declared {common_h}")
    for kind, have, listed in (("macro", sorted(header.macros), flist.macros),
                               ("status code", list(header.statuses), flist.statuses)):
        what = "ABI_MACROS" if kind == "macro" else "ABI_STATUSES"
        for m in have:
            if m not in listed:
                bad.append(f"{kind} {m} is in devshare.h but not in {src} (add it to {what})")
        for m in listed:
            if m not in have:
                bad.append(f"{kind} {m} is in {src} but not in devshare.h (remove it from {what})")
    return bad


# --- 3. The C compiler's view ----------------------------------------------------------------------


@dataclasses.dataclass
class CStruct:
    size: int
    align: int
    fields: list[tuple[str, int, int]]  # (name, offset, size) in declaration order


@dataclasses.dataclass
class Dump:
    structs: dict[str, CStruct]
    macros: dict[str, int]
    statuses: dict[str, int]


def find_cc() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


def parse_dump(out: str) -> Dump:
    """The lines abi_layout_print (tests/c/abi_fields.h) writes."""
    structs: dict[str, CStruct] = {}
    macros, statuses = {}, {}
    for line in out.splitlines():
        parts = line.split()
        if not parts:
            continue
        try:
            kv = {k: int(v) for k, v in (p.split("=", 1) for p in parts if "=" in p)}
            if parts[0] == "struct":
                structs[parts[1]] = CStruct(kv["size"], kv["align"], [])
            elif parts[0] == "field":
                structs[parts[1]].fields.append((parts[2], kv["offset"], kv["size"]))
            elif parts[0] == "macro":
                macros[parts[1]] = int(parts[2])
            elif parts[0] == "status":
                statuses[parts[1]] = int(parts[2])
            else:
                raise ValueError(parts[0])
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"layout line not understood: {line!r} ({type(e).__name__}: {e})") from None
    return Dump(structs, macros, statuses)


def run_dump(workdir: pathlib.Path, cc: str, source: pathlib.Path = DUMP_SOURCE,
             include: pathlib.Path = HEADER.parent) -> Dump:
    exe = workdir / "layout_dump"
    res = subprocess.run([cc, "-std=c11", "-Wall", "-Wextra", "-I", str(include), "-o", str(exe),
                          str(source)], capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise AssertionError(f"{cc} could not compile {source} against {include}:\n{res.stderr}")
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True, timeout=60).stdout
    return parse_dump(out)


def check_dump_complete(header: Header, dump: Dump, what: str = "the layout dump") -> list[str]:
    """The dump (``what`` printed it) covers exactly the header's structs, fields (in order), macros
    and status codes (with the header's values)."""
    bad = []
    fix = f"(the dump prints the lists of {_rel(FIELD_LIST)})"
    for s in sorted(set(header.structs) - set(dump.structs)):
        bad.append(f"struct {s} is in devshare.h but not in {what} {fix}")
    for s in sorted(set(dump.structs) - set(header.structs)):
        bad.append(f"struct {s} is in {what} but not in devshare.h {fix}")
    for s in sorted(set(header.structs) & set(dump.structs)):
        h = [f for f, _ in header.structs[s]]
        d = [f for f, _, _ in dump.structs[s].fields]
        if h != d:
            only_h = [f for f in h if f not in d]
            only_d = [f for f in d if f not in h]
            bad.append(f"{s}: devshare.h fields {h} != fields in {what} {d} (only in the header: "
                       f"{only_h}, only in the dump: {only_d}) {fix}")
    if header.statuses != dump.statuses:
        bad.append(f"status codes differ between devshare.h and {what} {fix}: "
                   f"header {sorted(set(header.statuses.items()) - set(dump.statuses.items()))}, "
                   f"dump {sorted(set(dump.statuses.items()) - set(header.statuses.items()))}")
    for m in sorted(header.macros - set(dump.macros)):
        bad.append(f"macro {m} is in devshare.h but not in {what} {fix}")
    for m in sorted(set(dump.macros) - header.macros):
        bad.append(f"macro {m} is in {what} but not in devshare.h {fix}")
    return bad


def check_dump_is_list(flist: FieldList, dump: Dump, what: str = "the layout dump") -> list[str]:
    """The dump names exactly what the list names, in its order: it was printed by a program built
    from this list (not from an older or newer copy)."""
    bad = []
    got = {s: [f for f, _, _ in cs.fields] for s, cs in dump.structs.items()}
    if got != flist.structs or list(got) != list(flist.structs):
        bad.append(f"{what} prints other structs or fields than {_rel(FIELD_LIST)} lists: "
                   f"{what} {got}, the list {flist.structs}")
    if list(dump.macros) != flist.macros:
        bad.append(f"{what} prints other macros than {_rel(FIELD_LIST)} lists: "
                   f"only in {what}: {[m for m in dump.macros if m not in flist.macros]}, "
                   f"only in the list: {[m for m in flist.macros if m not in dump.macros]}")
    if list(dump.statuses) != flist.statuses:
        bad.append(f"{what} prints other status codes than {_rel(FIELD_LIST)} lists: "
                   f"only in {what}: {[m for m in dump.statuses if m not in flist.statuses]}, "
                   f"only in the list: {[m for m in flist.statuses if m not in dump.statuses]}")
    return bad


# --- 4. ctypes ------------------------------------------------------------------------------------

_SIGNED = "bhilq"
_UNSIGNED = "BHILQ"
_INTS = {"int8_t": (1, True), "uint8_t": (1, False), "int16_t": (2, True), "uint16_t": (2, False),
         "int32_t": (4, True), "uint32_t": (4, False), "int64_t": (8, True), "uint64_t": (8, False),
         "size_t": (ctypes.sizeof(ctypes.c_size_t), False),
         "ptrdiff_t": (ctypes.sizeof(ctypes.c_ssize_t), True)}


def _tname(t) -> str:
    if t is None:
        return "None"
    if isinstance(t, type) and issubclass(t, ctypes._Pointer):  # noqa: SLF001
        return f"POINTER({_tname(t._type_)})"
    if isinstance(t, type) and issubclass(t, ctypes.Array):
        return f"{_tname(t._type_)} * {t._length_}"
    return getattr(t, "__name__", repr(t))


def _dim_value(dim: str, macros: dict[str, int]) -> int | None:
    dim = dim.strip()
    if re.fullmatch(r"\d+", dim):
        return int(dim)
    return macros.get(dim)


class Checker:
    """Checks ctypes types against a :class:`Header` and a :class:`Dump`."""

    def __init__(self, header: Header, dump: Dump):
        self.header = header
        self.dump = dump
        self._done: dict[tuple[str, type], list[str]] = {}

    # A declared C type against a ctypes type: None when they agree, else why not.
    def type_problem(self, ct: CType, py) -> str | None:
        want = f"C {ct} but ctypes {_tname(py)}"
        if ct.dims:
            if not (isinstance(py, type) and issubclass(py, ctypes.Array)):
                return want
            n = _dim_value(ct.dims[0], self.dump.macros)
            if n is not None and py._length_ != n:
                return f"{want} ({ct.dims[0]} = {n})"
            inner = self.type_problem(dataclasses.replace(ct, dims=ct.dims[1:]), py._type_)
            return f"{want}: {inner}" if inner else None
        if ct.ptr:
            if py is ctypes.c_void_p:
                return None
            if py is ctypes.c_char_p:
                return None if ct.ptr == 1 and ct.base in ("char", "uint8_t", "int8_t") else want
            if isinstance(py, type) and issubclass(py, ctypes._Pointer):  # noqa: SLF001
                if ct.ptr == 1 and ct.base == "void":
                    return None
                inner = self.type_problem(dataclasses.replace(ct, ptr=ct.ptr - 1), py._type_)
                return f"{want}: {inner}" if inner else None
            return want
        if ct.base == "void":
            return None if py is None else want
        if ct.struct or ct.base in self.header.structs or ct.base in self.header.opaque:
            if not (isinstance(py, type) and issubclass(py, ctypes.Structure)):
                return want
            if ct.base in self.header.opaque:
                return None if not getattr(py, "_fields_", None) else f"{want} (opaque in C)"
            inner = self.struct_problems(ct.base, py)
            return f"{want}: {'; '.join(inner)}" if inner else None
        if ct.base == "char":
            return None if py is ctypes.c_char else want
        if ct.base in _INTS:
            size, signed = _INTS[ct.base]
            code = getattr(py, "_type_", None)
            if not (isinstance(code, str) and code in (_SIGNED if signed else _UNSIGNED)
                    and ctypes.sizeof(py) == size):
                return want
            return None
        return f"C type {ct} is not known to abi_check (ctypes {_tname(py)})"

    def struct_problems(self, cname: str, cls) -> list[str]:
        """Everything that differs between ctypes class ``cls`` and C struct ``cname``."""
        key = (cname, cls)
        if key in self._done:
            return self._done[key]
        self._done[key] = []  # (no recursion into itself)
        bad: list[str] = []
        where = f"{cls.__module__}.{cls.__name__} vs {cname}"
        if cname not in self.header.structs:
            bad.append(f"{where}: devshare.h has no struct {cname}")
        elif cname not in self.dump.structs:
            bad.append(f"{where}: the layout dump has no struct {cname}")
        else:
            hfields = self.header.structs[cname]
            cs = self.dump.structs[cname]
            cfields = {f: (off, size) for f, off, size in cs.fields}
            pyfields = list(getattr(cls, "_fields_", []))
            pynames = [f[0] for f in pyfields]
            hnames = [f for f, _ in hfields]
            for f in hnames:
                if f not in pynames:
                    bad.append(f"{where}: field {f!r} is missing from the mirror")
            for f in pynames:
                if f not in hnames:
                    bad.append(f"{where}: the mirror has field {f!r}, which the C struct lacks")
            if not any("missing" in b or "lacks" in b for b in bad) and pynames != hnames:
                bad.append(f"{where}: field order differs: ctypes {pynames}, C {hnames}")
            if any(len(f) != 2 for f in pyfields):
                bad.append(f"{where}: bit-fields are not used in devshare.h")
            if getattr(cls, "_pack_", None) or getattr(cls, "_anonymous_", None):
                bad.append(f"{where}: _pack_/_anonymous_ are not used in devshare.h")
            htypes = dict(hfields)
            for name, typ in (f[:2] for f in pyfields):
                if name in htypes and name not in cfields:
                    bad.append(f"{where}: field {name!r} is not in the layout dump (the dump prints the "
                               f"lists of {_rel(FIELD_LIST)})")
                if name not in cfields or name not in htypes:
                    continue
                desc = getattr(cls, name)
                off, size = cfields[name]
                if desc.offset != off:
                    bad.append(f"{where}: offsetof({name}) is {off} in C, {desc.offset} in ctypes")
                if desc.size != size:
                    bad.append(f"{where}: sizeof({name}) is {size} in C, {desc.size} in ctypes")
                tp = self.type_problem(htypes[name], typ)
                if tp:
                    bad.append(f"{where}: field {name!r}: {tp}")
            if ctypes.sizeof(cls) != cs.size:
                bad.append(f"{where}: sizeof is {cs.size} in C, {ctypes.sizeof(cls)} in ctypes")
            if ctypes.alignment(cls) != cs.align:
                bad.append(f"{where}: alignment is {cs.align} in C, {ctypes.alignment(cls)} in ctypes")
        self._done[key] = bad
        return bad

    def mirrors_problems(self, mirrors: dict[str, type], *, complete: bool) -> list[str]:
        """Check a {C name: ctypes class} mapping; ``complete``: it must cover every C struct."""
        bad = []
        if complete:
            for s in sorted(set(self.header.structs) - set(mirrors)):
                bad.append(f"struct {s} has no ctypes mirror")
        for cname, cls in mirrors.items():
            bad += self.struct_problems(cname, cls)
        return bad

    def function_problems(self, name: str, restype, argtypes) -> list[str]:
        """A ctypes function signature against the header's prototype."""
        if name not in self.header.functions:
            return [f"{name}: not declared in devshare.h"]
        rt, params = self.header.functions[name]
        bad = []
        if argtypes is None or len(argtypes) != len(params):
            return [f"{name}: devshare.h has {len(params)} parameters, ctypes "
                    f"{'none declared' if argtypes is None else len(argtypes)}"]
        p = self.type_problem(rt, restype)
        if p:
            bad.append(f"{name}: return type: {p}")
        for i, (ct, py) in enumerate(zip(params, argtypes)):
            p = self.type_problem(ct, py)
            if p:
                bad.append(f"{name}: parameter {i + 1}: {p}")
        return bad


def init_functions(header: Header) -> dict[str, str]:
    """{struct: init function} for every ``devshare_<struct>_init(struct T *[, uint32_t size])``
    in the header."""
    out = {}
    for name, (_, params) in header.functions.items():
        if name.endswith("_init") and len(params) in (1, 2) and params[0].ptr == 1 \
                and params[0].base in header.structs:
            out[params[0].base] = name
    return out


def structs_in(module) -> dict[str, type]:
    """Every ctypes.Structure subclass with fields defined or bound in ``module``."""
    return {k: v for k, v in vars(module).items()
            if isinstance(v, type) and issubclass(v, ctypes.Structure) and getattr(v, "_fields_", None)}


def constant_problems(abi, dump: Dump) -> list[str]:
    """The constants of a mirror module (python/devshare/_abi.py: C_MACROS, Status,
    EXPECTED_MAJOR/MINOR) against the C compiler's values in the dump."""
    bad = []
    for pyname, cname in abi.C_MACROS.items():
        if cname not in dump.macros:
            bad.append(f"{cname} (mirrored as _abi.{pyname}) is not in the layout dump: not in devshare.h "
                       f"(or missing from {_rel(FIELD_LIST)})")
        elif getattr(abi, pyname) != dump.macros[cname]:
            bad.append(f"_abi.{pyname} = {getattr(abi, pyname)}, C {cname} = {dump.macros[cname]}")
    py = {"DEVSHARE_STATUS_" + s.name: int(s) for s in abi.Status}
    for name in sorted(set(py) | set(dump.statuses)):
        if py.get(name) != dump.statuses.get(name):
            bad.append(f"status {name}: _abi.Status says {py.get(name)}, C says {dump.statuses.get(name)}")
    # The mirrors' ABI target is one the header can satisfy: same major, minor not above it.
    major, minor = dump.macros.get("DEVSHARE_VERSION_MAJOR"), dump.macros.get("DEVSHARE_VERSION_MINOR")
    if abi.EXPECTED_MAJOR != major or minor is None or abi.EXPECTED_MINOR > minor:
        bad.append(f"_abi targets ABI {abi.EXPECTED_MAJOR}.{abi.EXPECTED_MINOR}, the header is {major}.{minor}")
    return bad
