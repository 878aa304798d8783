"""The house has no import circle: the import graph of cispo/ (every import a module runs,
at module level or deferred inside a function; ``if TYPE_CHECKING:`` and ``__main__`` blocks
left out) has no cycle."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "cispo"


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(path: Path) -> set[str]:
    """Dotted names this file imports at run time (absolute imports: the house style)."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and any(s in ast.unparse(node.test) for s in ("TYPE_CHECKING", "__main__")):
            skipped |= {id(n) for n in ast.walk(node)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the cispo modules it imports (a submodule also runs its packages' __init__)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        deps = set()
        for target in _imports(path):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in mods:
                    deps.add(prefix)
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
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


def test_the_checker_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_cispo():
    graph = import_graph()
    assert "cispo.trainer" in graph and "cispo.objective" in graph["cispo.trainer"]
    assert cycles(graph) == []


def documented_layers() -> list[str]:
    """The modules of docs/api.md's "Layers" table, top to bottom and left to right
    (``rollout/``: the package and its modules)."""
    text = (PACKAGE.parent / "docs" / "api.md").read_text()
    table = text.split("## Layers: the modules as they stand", 1)[1]
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| ") and "`" in line]
    return [name.strip(" `") for row in rows for name in row[2].split(",")]


def layer_violations(graph: dict[str, set[str]], order: list[str]) -> list[str]:
    """'a -> b' for every import of a module placed after it in ``order`` (its unit: a
    top-level module, or a package given as ``name/``), plus the modules ``order`` misses."""
    def unit(module: str) -> str:
        parts = module.split(".")[1:]
        return parts[0] + "/" if len(parts) > 1 or f"{parts[0]}/" in order else parts[0]

    position = {name: i for i, name in enumerate(order)}
    out = [f"{m} is not in the table" for m in graph if m != "cispo" and unit(m) not in position]
    for module, deps in graph.items():
        if module != "cispo" and unit(module) in position:
            here = position[unit(module)]
            out += [f"{module} -> {d}" for d in deps if d != "cispo" and position.get(unit(d), -1) > here]
    return sorted(out)


def test_the_layer_checker_finds_an_import_to_the_right():
    graph = {"cispo.a": set(), "cispo.b": {"cispo.a"}, "cispo.p.x": {"cispo.b"}, "cispo.c": set()}
    assert layer_violations(graph, ["a", "b", "p/"]) == ["cispo.c is not in the table"]
    assert layer_violations(graph, ["b", "a", "p/", "c"]) == ["cispo.b -> cispo.a"]
    assert layer_violations(graph, ["p/", "a", "b", "c"]) == ["cispo.p.x -> cispo.b"]


def test_the_documented_layers_hold():
    order = documented_layers()
    assert order[:2] == ["suggest", "distributed"] and order[-1] == "__main__" and len(set(order)) == len(order)
    assert layer_violations(import_graph(), order) == []
