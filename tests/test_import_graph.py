"""omnickpt's import graph has no cycle, counting the imports Python hides from a module-level reading:
those made inside functions and methods, and `importlib.import_module("omnickpt....")` with a literal
name (issue 18). The graph is read from the source with `ast`, so nothing is imported to build it.

How an import becomes an edge (module -> the module whose code it needs):
- `import omnickpt.a.b` and `importlib.import_module("omnickpt.a.b")`: to omnickpt.a.b;
- `from omnickpt.a import b`: to omnickpt.a.b when that is a module, else to the module that defines
  `b`: a package's `__init__` that only re-exports `b` (`from omnickpt.a.x import b`) is followed to
  omnickpt.a.x, as far as the re-exports go; a name the `__init__` defines itself is an edge to the package.
- Relative imports are resolved against the importing module; imports of other libraries are left out.
- Importing omnickpt.a.x also runs omnickpt.a's `__init__`; that implicit edge to a parent package is left
  out. Were it counted, every package whose `__init__` re-exports its submodules (all of them, and
  omnickpt/__init__.py re-exports the public API) would form a "cycle" with each submodule that merely
  lives inside it, and a real cycle would drown among them. An explicit import of a name the package's
  `__init__` itself defines still counts, by the rule above.
- Imports under `if TYPE_CHECKING:` are left out: they never run.
"""
from __future__ import annotations

import ast
from pathlib import Path

import omnickpt

ROOT = Path(omnickpt.__file__).resolve().parent
PACKAGE = "omnickpt"

# Edges known to close a cycle, each being removed by its own change; the lead empties this set once
# they land. Only these edges are left out, so any other cycle still fails the check. An entry whose
# import is gone is ignored (the change removing it may land before this set is emptied).
ALLOWED: dict[tuple[str, str], str] = {}   # no known cycle: an entry here must say why it is allowed


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its __init__)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _under_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(tree: ast.AST):
    """Every node of `tree`, less the bodies of `if TYPE_CHECKING:` (their `else:` is kept)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _under_type_checking(node):
            stack.extend(reversed(node.orelse))
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))   # reversed: visited in source order


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of a (possibly relative) `from` import's module."""
    if not level:
        return target or ""
    base = module.split(".")
    base = base[:len(base) - level + (1 if is_package else 0)]
    return ".".join(base + ([target] if target else []))


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, str | None]]:
    """(module, name) for each import in `tree`: name None for `import m` and import_module("m")."""
    found = []
    for node in _walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, is_package, node.level, node.module)
            found += [(source, alias.name) for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            found.append((node.args[0].value, None))
    return [(m, n) for m, n in found if m == PACKAGE or m.startswith(PACKAGE + ".")]


def _definer(package: str, name: str, modules: dict[str, Path], trees: dict[str, ast.AST]) -> str:
    """The module whose code `from package import name` needs: the submodule `package.name`, else the
    module the package's __init__ re-exports `name` from (followed through further re-exports), else
    the package itself."""
    seen = set()
    while package not in seen:
        seen.add(package)
        if f"{package}.{name}" in modules:
            return f"{package}.{name}"
        if package not in modules or not _is_package(package, modules):
            return package
        source = None
        for node in trees[package].body:   # a re-export is a module-level import of the package's __init__
            if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
                source = _absolute(package, True, node.level, node.module)
                name = next(a.name for a in node.names if (a.asname or a.name) == name)
        lazy = _lazy_exports(trees[package]).get(name)
        if source is None and lazy is not None:   # a lazy re-export (PEP 562, omnickpt/__init__.py)
            source, name = lazy
        if source is None or source not in modules:
            return package
        package = source
    return package


def _lazy_exports(tree: ast.AST) -> dict[str, tuple[str, str]]:
    """A package's lazy re-exports: the module-level `_PUBLIC = {name: (module, attribute)}` table its
    `__getattr__` imports from (omnickpt/__init__.py), so that `from omnickpt import save` is still an
    edge to the module that defines `save`."""
    for node in getattr(tree, "body", []):
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == "_PUBLIC" and isinstance(node.value, ast.Dict):
            try:
                table = ast.literal_eval(node.value)
            except ValueError:
                return {}
            return {k: tuple(v) for k, v in table.items() if isinstance(v, tuple) and len(v) == 2}
    return {}


def import_graph() -> dict[str, set[str]]:
    """module -> the omnickpt modules it imports, by the rules of this file's docstring."""
    modules = _modules()
    trees = {m: ast.parse(p.read_text(), filename=str(p)) for m, p in modules.items()}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, tree in trees.items():
        for target, name in _imports(tree, module, _is_package(module, modules)):
            if name is not None:
                target = _definer(target, name, modules, trees)
            while target not in modules and "." in target:   # `import omnickpt.a.b.c` where c is a name
                target = target.rsplit(".", 1)[0]
            if target in modules and target != module:
                graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (its modules, the first repeated at the end) per strongly connected component of
    more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(set(component))
    return [_cycle_in(graph, c) for c in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (by name), found breadth-first."""
    start = min(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return path[::-1] + [start]   # start, ..., node, start
                if child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    return sorted(component)


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    for (a, b) in ALLOWED:
        graph.get(a, set()).discard(b)
    found = cycles(graph)
    assert not found, "import cycles (each module imports the next, counting imports inside functions):\n" + \
        "\n".join(" -> ".join(c) for c in found)


def test_the_graph_sees_imports_hidden_inside_functions():
    # The check is only as good as what it reads: an import inside a method, a relative one and a
    # literal import_module are edges, one under TYPE_CHECKING is not.
    tree = ast.parse(
        "import importlib\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from omnickpt.api import save\n"
        "class C:\n"
        "    def f(self):\n"
        "        from omnickpt.format.manifest import decode_manifest\n"
        "        from . import tiered\n"
        "        return importlib.import_module('omnickpt.export.hf')\n")
    assert _imports(tree, "omnickpt.manager", False) == [
        ("omnickpt.format.manifest", "decode_manifest"), ("omnickpt", "tiered"), ("omnickpt.export.hf", None)]
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]


def test_a_lazy_re_export_is_followed_to_its_module():
    modules = _modules()
    trees = {m: ast.parse(p.read_text(), filename=str(p)) for m, p in modules.items()}
    assert _definer("omnickpt", "save", modules, trees) == "omnickpt.api"
    assert _definer("omnickpt", "CheckpointManager", modules, trees) == "omnickpt.manager"
