"""The house has no import circle: the import graph of cispo/ (every import a module runs,
at module level, deferred inside a function or in an ``if __name__ == "__main__":`` entry point;
``if TYPE_CHECKING:`` blocks left out) has no cycle, and it follows the layers of docs/api.md."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "cispo"


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
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
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
    assert "cispo.training.trainer" in graph and "cispo.objective.loss" in graph["cispo.training.trainer"]
    assert cycles(graph) == []


LAZY_FACES = ("objective", "config", "data", "models")
"""Layer folders whose ``__init__`` re-exports its modules' names on first use (`cispo.lazy_exports`)."""


def documented_layers() -> list[tuple[str, list[str]]]:
    r"""docs/api.md's "Layers" table, top to bottom: (folder, its entries left to right) per row.
    A cell reads ``\`folder/\`: \`a\`, \`sub/\`, ...`` (entries are folder/a, folder/sub/), or, for
    the front ends, names at cispo/'s top (\`integrations/\`, \`cli\`) with folder ``""``."""
    text = (PACKAGE.parent / "docs" / "api.md").read_text()
    table = text.split("## Layers: the folders and their modules", 1)[1]
    rows = []
    for line in table.splitlines():
        if line.startswith("| ") and "`" in line:
            cell = line.split("|")[2].strip()
            folder, _, names = cell.partition(":") if cell.startswith("`") and "/`:" in cell else ("", "", cell)
            folder = folder.strip(" `")
            rows.append((folder, [folder + name.strip(" `") for name in names.split(",")]))
    return rows


def unit_of(module: str, entries: set[str]) -> str | None:
    """The table entry holding ``module`` (``cispo.data.tasks.chain`` -> ``data/tasks/``), or None."""
    parts = module.split(".")[1:]
    for i in range(len(parts), 0, -1):
        path = "/".join(parts[:i])
        if (i == len(parts) and path in entries) or path + "/" in entries:
            return path if i == len(parts) and path in entries else path + "/"
    return None


def layer_violations(graph: dict[str, set[str]], rows: list[tuple[str, list[str]]]) -> list[str]:
    """'a -> b' for every import of a module whose entry comes after a's in the table (top to
    bottom, left to right); the modules the table misses; an entry outside its row's folder;
    a layer folder's ``__init__`` that imports a module outside its folder (it counts as the last
    entry of its row: ``from cispo.rollout import TorchSampler`` is an import of the whole row)."""
    order = [entry for _, entries in rows for entry in entries]
    position = {entry: i for i, entry in enumerate(order)}
    folders = {folder.rstrip("/") for folder, _ in rows if folder}
    last_of_row = {"cispo." + folder.rstrip("/").replace("/", "."): entries[-1] for folder, entries in rows if folder}
    out = [f"{entry} is not in {folder}" for folder, entries in rows for entry in entries
           if not entry.startswith(folder)]
    for module, deps in graph.items():
        if module == "cispo":
            continue
        if module.split(".", 1)[1] in folders:  # a layer folder's own __init__: its row's last entry
            out += [f"{module} -> {d}" for d in deps if d != "cispo" and not d.startswith(module + ".")]
            continue
        here = unit_of(module, set(order))
        if here is None:
            out.append(f"{module} is not in the table")
            continue
        for d in deps:
            there = None if d == "cispo" else last_of_row[d] if d in last_of_row else unit_of(d, set(order))
            if there is not None and position[there] > position[here]:
                out.append(f"{module} -> {d}")
    return sorted(out)


def test_the_layer_checker_finds_an_import_to_the_right():
    graph = {"cispo.f": set(), "cispo.f.a": set(), "cispo.f.b": {"cispo.f.a"}, "cispo.p.x": {"cispo.f.b"},
             "cispo.c": set()}
    rows = [("f/", ["f/a", "f/b"]), ("", ["p/"])]
    assert layer_violations(graph, rows) == ["cispo.c is not in the table"]
    assert layer_violations(graph, [("f/", ["f/b", "f/a"]), ("", ["p/", "c"])]) == ["cispo.f.b -> cispo.f.a"]
    assert layer_violations(graph, [("", ["p/"]), ("f/", ["f/a", "f/b"]), ("", ["c"])]) == ["cispo.p.x -> cispo.f.b"]
    assert layer_violations(graph, [("f/", ["f/a", "g/b"]), ("", ["p/", "c"])]) == \
        ["cispo.f.b is not in the table", "g/b is not in f/"]
    graph["cispo.f"] = {"cispo.f.a", "cispo.c"}  # a layer folder's __init__ imports its own folder only
    assert layer_violations(graph, rows + [("", ["c"])]) == ["cispo.f -> cispo.c"]
    graph["cispo.f"], graph["cispo.p.x"] = {"cispo.f.b"}, {"cispo.f"}  # the __init__ stands for its row's last entry
    assert layer_violations(graph, [("", ["p/"]), ("f/", ["f/a", "f/b"]), ("", ["c"])]) == ["cispo.p.x -> cispo.f"]


def test_the_documented_layers_hold():
    rows = documented_layers()
    order = [entry for _, entries in rows for entry in entries]
    assert order[:2] == ["foundations/suggest", "foundations/distributed"] and order[-1] == "__main__"
    assert len(set(order)) == len(order)
    assert layer_violations(import_graph(), rows) == []


def test_ls_cispo_reads_like_the_table():
    """Each folder of cispo/ is one row of the table, in the table's order of layers."""
    on_disk = sorted(p.name + "/" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    rows = documented_layers()
    in_table = [folder for folder, _ in rows if folder] + [e for folder, entries in rows if not folder
                                                            for e in entries if e.endswith("/")]
    assert sorted(in_table) == on_disk
    top_modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert top_modules == sorted(e for folder, entries in rows if not folder for e in entries if not e.endswith("/"))


def _names_imported_from(package: str) -> list[tuple[str, str]]:
    out = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == package:
                out += [(module, a.name) for a in node.names]
    return out


def test_cispo_imports_no_name_through_a_lazy_folder():
    """Inside cispo/, ``from cispo.objective import policy_loss`` would hide the import of
    ``cispo.objective.loss`` from the layer check: import from the module itself."""
    for face in LAZY_FACES:
        package = f"cispo.{face}"
        submodules = {m.rsplit(".", 1)[1] for m in _modules() if m.startswith(package + ".")}
        wrong = [(m, n) for m, n in _names_imported_from(package) if n not in submodules]
        assert wrong == [], f"import these from their modules, not through {package}: {wrong}"


def test_the_layer_folders_re_export_their_modules_names():
    """``from cispo.objective import policy_loss`` is the module's own name, imported on first use
    (`cispo.lazy_exports`); the package's top holds only ``__version__`` and ``lazy_exports``."""
    import importlib

    import cispo
    from cispo.config import TrainConfig, load_yaml  # noqa: F401 - the modules' names, from the folders
    from cispo.data import PromptStream  # noqa: F401
    from cispo.models import load_policy  # noqa: F401
    from cispo.objective import ObjectiveConfig, group_advantages, policy_loss, preset  # noqa: F401

    assert group_advantages is importlib.import_module("cispo.objective.advantages").group_advantages
    assert cispo.__all__ == ["__version__", "lazy_exports"]
    assert not hasattr(cispo, "MOVED")  # the flat layout's paths are gone: import from the folders

def test_the_docs_name_no_module_path_that_does_not_exist():
    """Every ``cispo.NAME`` the README and docs/*.md name (an import, ``python -m cispo.X``) starts with a
    folder or module of cispo/, or a name of its top: the flat layout's paths (``cispo.trainer``) are gone."""
    import re

    import cispo

    top = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()} | set(cispo.__all__)
    root = PACKAGE.parent
    docs = [root / "README.md", *(root / "docs").glob("*.md")]
    wrong = sorted({f"{doc.relative_to(root)}: cispo.{name}" for doc in docs
                    for name in re.findall(r"(?<![\w/.-])cispo\.(\w+)", doc.read_text())
                    if name not in top and not name.startswith("__")})
    assert wrong == []
