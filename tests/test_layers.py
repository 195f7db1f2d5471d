"""The house's shape, read from the code's own import statements: folders are layers and imports only go down.

Layers, low to high: root utilities (batch_invariant, resources, jsonio) < attention | quant < parallel < moe < model
< text < serve | train | sim (one floor: none imports another) < apps < cli.  Root utilities import none another
but for the pairs ``UTILITY_EDGES`` names (prepacked sits below batch_invariant, whose ``linear`` uses its
copies, panel_gemm below prepacked, which packs matrices for its kernel, and operators below prepacked, which
registers the Python kernel of the operator its products call).  No module imports one that imports it (cycles,
function-local imports included), and no function hides an import of the package inside itself, except where
laziness is the point: the CLI loads a command's job only when it runs, and the Triton kernels load only when asked
for (the package imports without Triton).
"""

from __future__ import annotations

import ast
from pathlib import Path

import ringmoe

ROOT = Path(ringmoe.__file__).resolve().parent
LAYERS = {"attention": 1, "quant": 1, "parallel": 2, "moe": 3, "model": 4, "text": 5, "serve": 6, "train": 6, "sim": 6,
          "apps": 7, "cli": 8}
UTILITY_EDGES = {("ringmoe.batch_invariant", "ringmoe.prepacked"), ("ringmoe.prepacked", "ringmoe.panel_gemm"),
                 ("ringmoe.operators", "ringmoe.panel_gemm"), ("ringmoe.prepacked", "ringmoe.operators")}
LAZY_ALLOWED = {"ringmoe.cli": None,                                                # every command's job
                "ringmoe.attention.kernels": {"ringmoe.attention.triton_flash"},     # optional Triton
                "ringmoe.attention.paged": {"ringmoe.attention.triton_flash", "ringmoe.attention.triton_paged"},
                "ringmoe.quant.matmul": {"ringmoe.quant.triton_gemm"}}


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = ["ringmoe", *path.relative_to(ROOT).with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _resolve(target: str, known) -> str | None:
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def _imports(name: str, path: Path, known) -> list[tuple[str, bool]]:
    """(imported package module, inside a function?) for every import statement of ``name``."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    local = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for node in ast.walk(fn)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [t for t in (f"{prefix}.{a.name}" for a in node.names) if t in known] or [prefix]
        else:
            continue
        for target in targets:
            resolved = _resolve(target, known) if target.startswith("ringmoe") else None
            if resolved and resolved != name:
                out.append((resolved, id(node) in local))
    return out


def _layer(module: str) -> tuple[int, str]:
    parts = module.split(".")
    if len(parts) == 1:
        return 0, "ringmoe"
    top = parts[1]
    return LAYERS.get(top, 0), top


GRAPH = {name: _imports(name, path, _modules()) for name, path in _modules().items()}


def test_imports_only_go_down_the_layers():
    wrong = []
    for name, imports in GRAPH.items():
        (mine, folder) = _layer(name)
        for target, _ in imports:
            (theirs, other) = _layer(target)
            if (folder != other and theirs >= mine and not (name == "ringmoe" and theirs <= 1)
                    and (name, target) not in UTILITY_EDGES):
                wrong.append(f"{name} ({folder}, layer {mine}) imports {target} ({other}, layer {theirs})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = {name: {t for t, _ in imports} for name, imports in GRAPH.items()}
    state, cycles = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not cycles, "\n".join(cycles)


def test_no_function_hides_an_import_of_the_package():
    hidden = [f"{name} imports {target} inside a function" for name, imports in GRAPH.items()
              for target, local in imports
              if local and name not in LAZY_ALLOWED or (local and LAZY_ALLOWED.get(name) is not None
                                                        and target not in LAZY_ALLOWED[name])]
    assert not hidden, "\n".join(hidden)


def test_the_graph_is_read_at_all():
    """The checks above would pass on an empty graph: the package's known edges are there."""
    edges = {name: {t for t, _ in imports} for name, imports in GRAPH.items()}
    assert "ringmoe.model.transformer" in edges["ringmoe.serve.runner"]
    assert "ringmoe.attention.triton_flash" in edges["ringmoe.attention.kernels"]
    assert len(GRAPH) > 60
