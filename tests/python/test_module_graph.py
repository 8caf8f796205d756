"""The package's modules: each imports on its own, they import each other in declared layers (so
there is no cycle), and none uses another's private names.

- Every ``devshare._*`` module is imported alone in a fresh interpreter, with the package's
  ``__init__`` kept out of the way (a bare package object stands in for it): a plain
  ``import devshare._x`` would run ``__init__`` first, whose import order can hide a module
  that only works after another was imported. Exactly the modules it imports (by the graph
  below) get loaded.
- Every module is parsed with :mod:`ast`; its imports of the package's modules, at module level
  and inside functions, form the graph. Each module sits in one layer of :data:`LAYERS` and
  may import only modules of lower layers: a new upward import, or a new module not placed in
  a layer, fails here. Imports of the package inside functions are refused outright (they are
  how cycles get hidden); lazy imports of torch, numpy and torch_npu are fine.
- No module reads ``<sibling>._<name>`` or imports ``_<name>`` from a sibling: what a module
  shares with its siblings it names without a leading underscore (the underscore is on the
  module).

- The channel API's modules keep their own order within the layers (:data:`CHANNEL_ORDER`): the
  library binding, then the ownership rules, then the channel objects, then the facade
  ``_channel``; only the binding imports the library's channel signatures.

The checks are functions of source text, and the last tests feed them sources that break each
rule, so that they are known to fail when they should.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

import devshare

PACKAGE = "devshare"
PACKAGE_DIR = pathlib.Path(devshare.__file__).resolve().parent

#: The layers, lowest first. A module may import only modules of lower layers.
LAYERS: list[list[str]] = [
    ["_abi", "_ints", "_paths"],  # the C ABI's mirrors; integer checks; the wheel's paths
    ["_dtypes", "_lib"],  # element types; loading and calling the library
    ["_args", "_dlpack", "_handle_struct"],  # argument checks; DLPack; a handle struct's extras
    ["_torch_tuples", "_views"],  # PyTorch IPC tuples <-> structs; memory <-> tensors/arrays
    ["_handle"],  # the Handle class
    ["_registry", "_torch_ipc"],  # this process's exporters and imports; device tensors
    ["_api"],  # share / open / empty / outstanding / wait / discard / dlpack_capsule
    ["_channel_lib"],  # the library's channel functions, bound once for its version
    ["_ownership", "_channel_memory"],  # one process's objects; channel memory and layouts
    ["_leases", "_pool"],  # a received item's import; pools and slots
    ["_connection", "_producer"],  # the consumer end and its items; the producer end (Channel)
    ["_channel"],  # the channel API's one import point
    ["__init__"],  # the public facade
    ["__main__"],  # python -m devshare
]
LAYER_OF = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def package_modules() -> dict[str, str]:
    """Module name (``_lib``, ``__init__``, ...) -> source text, for every .py file of the package."""
    return {p.stem: p.read_text() for p in sorted(PACKAGE_DIR.glob("*.py"))}


# --- the checks, on source text -------------------------------------------------------------------


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _parents(tree: ast.AST) -> dict:
    out = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            out[child] = node
    return out


def _in_function(node, parents) -> bool:
    node = parents.get(node)
    while node is not None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return True
        node = parents.get(node)
    return False


def imports_of(name: str, source: str, modules) -> list[dict]:
    """The package imports in ``source`` (module ``name``): one dict per imported module with
    ``target`` (a module name, ``__init__`` for the package itself), ``names`` (what was
    imported from it: ``None`` for the module object itself), ``bound`` (the name the module
    object is bound to, if it is), ``line`` and ``local`` (inside a function)."""
    tree = ast.parse(source, filename=f"{name}.py")
    parents = _parents(tree)
    out = []

    def add(node, target, names=None, bound=None):
        out.append({"target": target, "names": names, "bound": bound, "line": node.lineno,
                    "local": _in_function(node, parents)})

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] != PACKAGE:
                    continue
                target = parts[1] if len(parts) > 1 else "__init__"
                add(node, target, bound=alias.asname if alias.asname and len(parts) > 1 else None)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] != PACKAGE:
                    continue
                sub = parts[1] if len(parts) > 1 else None
            elif node.level == 1:
                sub = node.module.split(".")[0] if node.module else None
            else:
                raise AssertionError(f"{name}.py:{node.lineno}: relative import from outside the "
                                     f"package")
            if sub is not None:
                add(node, sub, names=[a.name for a in node.names])
                continue
            # from . import a, b: modules of the package, or names of its __init__
            for alias in node.names:
                if alias.name in modules:
                    add(node, alias.name, bound=alias.asname or alias.name)
                else:
                    add(node, "__init__", names=[alias.name])
    return out


def layer_problems(graph: dict[str, list[dict]]) -> list[str]:
    """Modules missing from LAYERS (or named there but absent), imports inside functions, and
    imports of a module that is not in a lower layer."""
    problems = [f"{m}: not in any layer of LAYERS (put it in one)" for m in graph
                if m not in LAYER_OF]
    problems += [f"{m}: in LAYERS but not in the package" for m in LAYER_OF if m not in graph]
    for m, imports in graph.items():
        for imp in imports:
            where = f"{m}.py:{imp['line']}"
            if imp["local"]:
                problems.append(f"{where}: imports {imp['target']} inside a function (import it at "
                                f"module level, from a lower layer)")
            if imp["target"] not in graph:
                problems.append(f"{where}: imports {imp['target']}, which is not a module of the "
                                f"package")
            elif m in LAYER_OF and imp["target"] in LAYER_OF \
                    and LAYER_OF[imp["target"]] >= LAYER_OF[m]:
                problems.append(f"{where}: imports {imp['target']} (layer "
                                f"{LAYER_OF[imp['target']]}), not below {m} (layer {LAYER_OF[m]})")
    return problems


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def private_uses(name: str, source: str, modules) -> list[str]:
    """Uses of a sibling's private names in ``source``: ``from ._x import _y`` and ``_x._y``
    (``_x`` bound to a sibling module by an import)."""
    imports = imports_of(name, source, modules)
    problems = []
    bound = {}
    for imp in imports:
        if imp["bound"]:
            bound[imp["bound"]] = imp["target"]
        for n in imp["names"] or ():
            if _is_private(n) and n not in modules:
                problems.append(f"{name}.py:{imp['line']}: imports {n} from {imp['target']}")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in bound and _is_private(node.attr):
            problems.append(f"{name}.py:{node.lineno}: reads {node.value.id}.{node.attr} "
                            f"(a private name of {bound[node.value.id]})")
    return problems


def closure(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(edges.get(m, ()))
    return seen


def graph_of(sources: dict[str, str]) -> dict[str, list[dict]]:
    return {m: imports_of(m, src, sources) for m, src in sources.items()}


def edges_of(graph) -> dict[str, set[str]]:
    return {m: {i["target"] for i in imports} for m, imports in graph.items()}


# --- the package ----------------------------------------------------------------------------------

SOURCES = package_modules()
GRAPH = graph_of(SOURCES)
EDGES = edges_of(GRAPH)
SUBMODULES = sorted(m for m in SOURCES if m.startswith("_") and not m.startswith("__"))

_ALONE = textwrap.dedent("""
    import importlib, json, sys, types
    package = types.ModuleType("devshare")  # stands in for the package's __init__
    package.__path__ = [sys.argv[1]]
    sys.modules["devshare"] = package
    importlib.import_module("devshare." + sys.argv[2])
    print(json.dumps(sorted(m.split(".", 1)[1] for m in sys.modules if m.startswith("devshare."))))
""")


@pytest.mark.parametrize("module", SUBMODULES)
def test_each_module_imports_alone(module):
    r = subprocess.run([sys.executable, "-c", _ALONE, str(PACKAGE_DIR), module],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"import devshare.{module} alone failed:\n{r.stderr}"
    loaded = set(json.loads(r.stdout.strip().splitlines()[-1]))
    # What it loads is what the graph says it imports, and so what the layer check saw.
    assert loaded == closure(EDGES, module), (module, sorted(loaded))


def test_the_package_and_python_m_import_in_a_fresh_interpreter():
    code = "import devshare, devshare.__main__; print(devshare.__main__.__version__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=str(PACKAGE_DIR.parent))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == devshare.__version__


def test_the_modules_import_in_layers():
    assert SUBMODULES, "no modules found"
    problems = layer_problems(GRAPH)
    assert not problems, "\n".join(problems)


def test_the_import_graph_has_no_cycle():
    assert find_cycle(EDGES) is None, " -> ".join(find_cycle(EDGES))


def test_no_module_uses_a_siblings_private_names():
    problems = [p for m, src in SOURCES.items() for p in private_uses(m, src, SOURCES)]
    assert not problems, "\n".join(problems)


#: The channel API's modules, lowest first: the library binding, the ownership rules, the objects
#: (with the memory and lease helpers they share), and the facade the package imports them from.
CHANNEL_ORDER = [["_channel_lib"], ["_ownership"], ["_leases", "_pool", "_connection", "_producer"],
                 ["_channel"]]


def channel_problems(graph, layer_of=None) -> list[str]:
    """Breaks of the channel modules' order: binding < ownership < channel objects < facade in
    the layers, every object module built on the binding and the ownership rules, nothing but
    the package's ``__init__`` importing the facade, and no module but the binding (and the ABI
    modules that define them) importing the library's channel signatures, so that the library
    is bound and its version looked at in one place."""
    layer_of = LAYER_OF if layer_of is None else layer_of
    edges = edges_of(graph)
    problems = [f"{a}: not below {b} in LAYERS"
                for lower, upper in zip(CHANNEL_ORDER, CHANNEL_ORDER[1:])
                for a in lower for b in upper if layer_of[a] >= layer_of[b]]
    problems += [f"{m}: does not import _channel_lib and _ownership" for m in CHANNEL_ORDER[2]
                 if not {"_channel_lib", "_ownership"} <= closure(edges, m)]
    problems += [f"{m}: imports the facade _channel" for m, targets in edges.items()
                 if "_channel" in targets and m != "__init__"]
    problems += [f"{m}.py:{imp['line']}: imports {n} (only _channel_lib binds the channel "
                 f"functions)"
                 for m, imports in graph.items() if m not in ("_abi", "_lib", "_channel_lib")
                 for imp in imports for n in imp["names"] or ()
                 if n.startswith("channel_signatures")]
    return problems


def test_the_channel_modules_keep_their_order():
    problems = channel_problems(GRAPH)
    assert not problems, "\n".join(problems)


# --- the checks fail when they should -------------------------------------------------------------


def _with(module: str, extra: str) -> dict[str, str]:
    sources = dict(SOURCES)
    sources[module] = sources[module] + "\n" + textwrap.dedent(extra)
    return sources


@pytest.mark.parametrize("module, extra, expected", [
    ("_lib", "from ._api import share\n", "_lib.py:"),  # upward, at module level
    ("_registry", "from . import _channel\n", "imports _channel (layer"),  # upward, module form
    ("_registry", "import devshare._api\n", "imports _api (layer"),  # absolute form
    ("_handle", "def f():\n    from ._torch_ipc import torch_args\n", "inside a function"),
    ("_views", "from ._views import view\n", "imports _views (layer 3), not below _views"),
])
def test_the_layer_check_catches(module, extra, expected):
    problems = layer_problems(graph_of(_with(module, extra)))
    assert any(expected in p for p in problems), problems


def test_the_layer_check_catches_a_module_in_no_layer():
    sources = dict(SOURCES, _new="from ._lib import lib\n")
    assert "_new: not in any layer of LAYERS (put it in one)" in layer_problems(graph_of(sources))


def test_the_cycle_check_catches_a_cycle_hidden_in_a_function():
    sources = _with("_handle", "def f():\n    from ._torch_ipc import handle_from_torch\n")
    cycle = find_cycle(edges_of(graph_of(sources)))
    assert cycle is not None and cycle[0] == cycle[-1] and {"_handle", "_torch_ipc"} <= set(cycle)


@pytest.mark.parametrize("extra, expected", [
    ("from ._registry import _adopted\n", "imports _adopted from _registry"),
    ("from . import _registry\nx = _registry._buffers\n", "reads _registry._buffers"),
    ("from . import _registry as reg\nx = reg._imports\n", "reads reg._imports"),
    ("import devshare._registry as reg\nx = reg._imports\n", "reads reg._imports"),
    ("def f():\n    return _views._private_helper()\n", "reads _views._private_helper"),
])
def test_the_private_name_check_catches(extra, expected):
    src = _with("_connection", extra)["_connection"]  # (it imports _views)
    problems = private_uses("_connection", src, SOURCES)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize("module, extra, expected", [
    ("_pool", "from ._lib import channel_signatures_1_4\n", "_pool.py:"),
    ("_connection", "from . import _channel\n", "_connection: imports the facade"),
])
def test_the_channel_order_check_catches(module, extra, expected):
    problems = channel_problems(graph_of(_with(module, extra)))
    assert any(expected in p for p in problems), problems


def test_the_channel_order_check_catches_a_layer_out_of_order():
    layer_of = dict(LAYER_OF, _ownership=LAYER_OF["_producer"])
    assert "_ownership: not below _pool in LAYERS" in channel_problems(GRAPH, layer_of)
