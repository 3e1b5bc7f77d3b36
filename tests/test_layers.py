"""Issue #10: the layers show in the imports. A module imports only its own layer or lower ones, in
functions too (an import inside a function is still a dependency), and no two packages import each other.

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


def test_every_package_has_a_layer():
    assert {a for a, _, _ in edges()} | {b for _, b, _ in edges()} <= set(RANK)


def test_no_module_imports_a_higher_layer():
    up = sorted(f"{where}: {a} imports {b}" for a, b, where in edges() if RANK[b] > RANK[a])
    assert not up, "\n".join(up)


def test_no_two_packages_import_each_other():
    pairs = {(a, b) for a, b, _ in edges() if a != b}
    both = sorted({tuple(sorted(p)) for p in pairs if (p[1], p[0]) in pairs})
    assert not both, both


if __name__ == "__main__":  # `python tests/test_layers.py` prints which layer imports which
    pairs = sorted({(a, b) for a, b, _ in edges() if a != b}, key=lambda p: (RANK[p[0]], p))
    for a, group in itertools.groupby(pairs, key=lambda p: p[0]):
        print(f"{a:>10} -> {', '.join(b for _, b in group)}")
