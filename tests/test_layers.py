"""Issue #10: the layers show in the imports. A module imports only its own layer or lower ones, in
functions too (an import inside a function is still a dependency), and no two packages import each other.
Issue #48: no two modules import each other either, through any chain, except under TYPE_CHECKING (a type
named in an annotation is not a dependency at run time).

    errors, files, results  <-  hardware, runs  <-  plan  <-  workloads  <-  train, bench, serve, report, launch
        <-  views, ui, cli
"""

import ast
import itertools
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "gpuwise"
RANK = {
    "gpuwise": 0,
    "errors": 0,
    "files": 0,
    "results": 0,
    "hardware": 1,
    "runs": 1,
    "plan": 2,
    "workloads": 3,
    "train": 4,
    "bench": 4,
    "serve": 4,
    "report": 4,
    "launch": 4,
    "fleet": 4,
    "views": 5,
    "ui": 5,
    "cli": 5,
    "__main__": 6,
}


def part(module: str) -> str:
    """The layer a dotted module name belongs to: its top package under gpuwise (cli_*.py and cli/ are cli)."""
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else "gpuwise"
    return "cli" if name.startswith("cli") else name


def edges() -> set[tuple[str, str, str]]:
    found = set()
    for path in SRC.rglob("*.py"):
        module = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("gpuwise"):
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("gpuwise")]
            else:
                continue
            found |= {(part(module), part(t), f"{path.relative_to(SRC)}:{node.lineno}") for t in targets}
    return found


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")


MODULES = {module_of(p): p for p in SRC.rglob("*.py")}


def _owner(name: str) -> str | None:
    """The module of this package a dotted name is or lies in (a module, or a name inside one)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_only(tree: ast.AST) -> set[int]:
    nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            nodes |= {id(n) for n in ast.walk(node)}
    return nodes


def module_imports() -> dict[str, set[str]]:
    """Which of this package's modules each module imports at run time: at its top or in a function, relative
    imports resolved, a name imported from a module counted as that module; type-only imports left out."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        skip = _type_only(tree)
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                targets = [_owner(f"{base}.{a.name}") or _owner(base) for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [_owner(a.name) for a in node.names]
            else:
                continue
            graph[module] |= {t for t in targets if t and t != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_circles_between_modules():
    found = circles(module_imports())
    assert not found, "modules that import each other, through some chain:\n" + "\n".join(map(", ".join, found))


def test_the_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def imports_inside_functions() -> list[tuple[str, int, bool]]:
    """(file, line, whether a comment says why) of each import of this package inside a function. The why is a
    comment on the import block: on one of its lines or on the line above it."""
    found = []
    for path in SRC.rglob("*.py"):
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, ast.Import | ast.ImportFrom):
                    continue
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                if not any(n.startswith("gpuwise") for n in names) or getattr(node, "level", 0):
                    continue
                top, end = node.lineno - 1, node.end_lineno or node.lineno
                while top > 0 and (_is_import(lines[top - 1]) or not lines[top - 1].strip() and _is_import(lines[top - 2])):  # fmt: skip  # noqa: E501
                    top -= 1
                block = lines[top - 1 : end]  # the line above the block, and the block
                found.append((f"{path.relative_to(SRC)}:{node.lineno}", node.lineno, any("#" in x for x in block)))
    return found


def _is_import(line: str) -> bool:
    text = line.strip()
    return text.startswith(("from ", "import ")) or text == ")" or (text.endswith(",") and " " not in text.rstrip(","))


def test_an_import_inside_a_function_says_why():
    """#48: an import stays inside a function only to keep a command's start-up light or to break a dependency on
    an optional package, and a comment says which. Fewer than half of the 206 there were."""
    found = imports_inside_functions()
    silent = sorted(where for where, _, why in found if not why)
    assert not silent, "imports inside functions with no comment saying why:\n" + "\n".join(silent)
    assert len(found) <= 103, len(found)


def test_every_package_has_a_layer():
    assert {a for a, _, _ in edges()} | {b for _, b, _ in edges()} <= set(RANK)


def test_no_module_imports_a_higher_layer():
    up = sorted(f"{where}: {a} imports {b}" for a, b, where in edges() if RANK[b] > RANK[a])
    assert not up, "\n".join(up)


def test_no_two_packages_import_each_other():
    pairs = {(a, b) for a, b, _ in edges() if a != b}
    both = sorted({tuple(sorted(p)) for p in pairs if (p[1], p[0]) in pairs})
    assert not both, both


def longest_functions(n: int = 5) -> list[tuple[int, str]]:
    found = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                found.append((lines, f"{path.relative_to(SRC)}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)[:n]


if __name__ == "__main__":  # `python tests/test_layers.py`: which layer imports which, and the house's figures
    pairs = sorted({(a, b) for a, b, _ in edges() if a != b}, key=lambda p: (RANK[p[0]], p))
    for a, group in itertools.groupby(pairs, key=lambda p: p[0]):
        print(f"{a:>10} -> {', '.join(b for _, b in group)}")
    print(f"import circles between modules: {len(circles(module_imports()))}")
    inside = imports_inside_functions()
    print(f"imports of gpuwise inside functions: {len(inside)} in {len({w.split(':')[0] for w, _, _ in inside})} files")
    print("longest functions:", "; ".join(f"{where} ({lines} lines)" for lines, where in longest_functions()))
