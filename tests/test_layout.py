"""The package's layout keeps its promises: data flows down the rooms and never back up.

Walks every ``import`` in ``jaxray`` (module top and function bodies alike) with ``ast``, without
importing anything, and fails on an import cycle, on an import that runs up the flow, on an import
inside a function without a reason written beside it, and on a module or function over its size.
The rooms, bottom to top, are docs/architecture.md's layout.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jaxray"

# Bottom to top: a module may import from its own room or a room before it, never after it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("jaxray.argtypes",),
    ("jaxray.storage",),
    ("jaxray.config",),
    ("jaxray.data",),
    ("jaxray.models",),
    ("jaxray.parallel",),
    ("jaxray.checkpoint",),
    ("jaxray.folders", "jaxray.runs"),
    ("jaxray.train",),
    ("jaxray.reporting",),
    ("jaxray.runner",),
    ("jaxray.inference",),
    ("jaxray.raytrain",),
    ("jaxray.serve",),
    ("jaxray.bench",),
    (
        "jaxray.tune",
        "jaxray.generate",
        "jaxray.export",
        "jaxray.evaluate",
        "jaxray.doctor",
        "jaxray.local",
        "jaxray.local_run",
    ),
)
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> int:
    """The room's index in LAYERS; KeyError for a module no room holds (add it to LAYERS)."""
    for i, room in enumerate(LAYERS):
        if any(module == r or module.startswith(r + ".") for r in room):
            return i
    raise KeyError(f"{module} belongs to no room of LAYERS")


def _target(module: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The jaxray modules an import statement loads (``from pkg import mod`` names the module)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]
            package = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
            base = f"{package}.{base}" if base else package
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    found = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name.startswith("jaxray"):
            found.append(name)
    return found


def _parse(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text())


def imports(module: str) -> set[str]:
    """Every jaxray module ``module`` imports, wherever the import statement stands."""
    found: set[str] = set()
    for node in ast.walk(_parse(module)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.update(t for t in _target(module, node) if t != module)
    return found


GRAPH = {m: imports(m) for m in MODULES}


def test_every_module_belongs_to_a_room():
    for module in MODULES:
        if module != "jaxray":  # the package itself is empty
            layer(module)


def test_no_import_runs_up_the_flow():
    upward = [
        f"{m} imports {t}"
        for m, targets in GRAPH.items()
        for t in sorted(targets)
        if layer(t) > layer(m) and not t == "jaxray"  # `jaxray` itself is the empty package
    ]
    assert not upward, "imports against the flow:\n" + "\n".join(upward)


INSTRUMENTS = "jaxray.bench"  # measuring instruments: fenced from the product


def test_no_product_module_imports_an_instrument():
    """The product (``jaxray`` without ``bench/``) is what a user runs: nothing of it imports
    ``jaxray.bench``, so the instruments can change, or go, without touching it."""
    crossing = [
        f"{m} imports {t}"
        for m, targets in GRAPH.items()
        for t in sorted(targets)
        if t.startswith(INSTRUMENTS) and not m.startswith(INSTRUMENTS)
    ]
    assert not crossing, "the product imports an instrument:\n" + "\n".join(crossing)


def test_no_product_module_names_fault_injection():
    """Fault injection is test code (tests/faults.py): it reaches the workers through Ray's setup hook
    and ``jaxray.raytrain.seams``; no product module names it."""
    named = [
        m
        for m, path in MODULES.items()
        if re.search(
            r"JAXRAY_FAULT|fault injection|raytrain\.faults|import faults|from faults", path.read_text()
        )
    ]
    assert not named, f"modules naming fault injection: {named}"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None; depth-first with an explicit stack."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for root in graph:
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_no_import_cycle():
    package_inits = {m for m in MODULES if MODULES[m].name == "__init__.py"}
    # `from jaxray.x import y` loads jaxray.x's __init__ first; an empty __init__ closes no loop.
    graph = {m: {t for t in ts if t not in package_inits or GRAPH[t]} for m, ts in GRAPH.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def _top_level(tree: ast.Module) -> set[int]:
    """ids of the nodes at module level, including those under a top-level if/try."""
    top = {id(n) for n in tree.body}
    for node in tree.body:
        if isinstance(node, ast.If | ast.Try):
            top.update(id(n) for n in ast.walk(node))
    return top


def test_imports_inside_functions_say_why():
    unexplained = []
    for module, path in MODULES.items():
        lines = path.read_text().splitlines()
        tree = _parse(module)
        top = _top_level(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in top:
                here, above = lines[node.lineno - 1], lines[node.lineno - 2].strip()
                if "#" not in here and not above.startswith("#"):
                    unexplained.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {here.strip()}")
    assert not unexplained, "imports inside functions need a reason beside them:\n" + "\n".join(unexplained)


def test_modules_and_functions_stay_small():
    too_big = []
    for module, path in MODULES.items():
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_big.append(f"{module}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    too_big.append(f"{module}.{node.name}: {size} lines")
    assert not too_big, (
        f"over {MAX_MODULE_LINES} lines a module, {MAX_FUNCTION_LINES} a function:\n" + "\n".join(too_big)
    )


def test_what_ray_unpickles_outside_the_worker_imports_no_jax():
    # Tune's trial process unpickles the trainable, Ray Train's controller the worker loop, Ray Data's
    # processes the draw function: each a process per trial, which must not pay for JAX, Flax and
    # Orbax (docs/benchmarks.md, make demo).
    import subprocess
    import sys

    code = (
        "import sys, jaxray.raytrain.entry, jaxray.raytrain.trainable, jaxray.data.ray_data, jaxray.config; "
        "print(sorted(m for m in ('jax', 'flax', 'orbax', 'optax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
