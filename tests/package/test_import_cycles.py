"""The package's modules import each other without cycles: a cycle means two modules share a
responsibility that belongs in a third (and an import moved into a function to dodge one hides it).

Every `import` / `from ... import` of an `fms_paged` module counts, at module level or inside a
function, except under `if TYPE_CHECKING:` (never run). An import names the deepest module it
reaches: `from fms_paged.kv import geometry` is an edge to `fms_paged.kv.geometry`, `from
fms_paged.kv import PageManager` one to the package `fms_paged.kv` (its `__init__`). Importing a
module runs its parents' `__init__` too, but a parent re-exporting its children is not a cycle of
responsibilities, so that implicit edge is not counted."""

import ast
from pathlib import Path

import fms_paged

ROOT = Path(fms_paged.__file__).parent


def module_names() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package."""
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = ("fms_paged",) + path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules that `name`'s source imports (see the module docstring)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skip = set()
    for node in ast.walk(tree):  # the bodies of `if TYPE_CHECKING:`
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import fms_paged.kv.geometry as g` and the like
                t = t.rpartition(".")[0]
            if t and t.startswith("fms_paged") and t != name:
                found.add(t)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def package_graph() -> dict[str, set[str]]:
    known = module_names()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_the_cycle_finder_sees_a_cycle():
    """The finder itself: a two-module cycle and a three-module one are found, a chain is not."""
    g = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(cycles(g)) == [["a", "b"], ["c", "d", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_package_modules():
    graph = package_graph()
    assert "fms_paged.engine.engine" in graph and graph["fms_paged.engine.engine"]  # the graph is real
    found = cycles(graph)
    assert not found, "import cycles among fms_paged modules:\n" + "\n".join(
        " <-> ".join(c) + "\n    " + "; ".join(f"{m} imports {sorted(graph[m] & set(c))}" for m in c)
        for c in found
    )
