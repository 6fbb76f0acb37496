"""The layer order of the parts, read from the source: every folder is declared in one layer, and a module imports
only its own layer and the layers below; no import cycles between folders or files; function-local imports only
where a listed reason needs them; the bundle runtime free of JAX; files and functions within size."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("llada_jax", "policies", "lowering", "eval")

# Lowest first: each layer is a list of folders (every folder holding a module is declared once), and a module
# may import its own layer and any layer below it. A file's folder says its layer.
LAYERS = (
    ("system", ("llada_jax/system",)),
    ("kernels", ("llada_jax/kernels",)),
    ("families", ("llada_jax/families",)),
    ("quant", ("llada_jax/quant",)),
    ("model", ("llada_jax/model",)),
    ("staging", ("llada_jax/staging",)),
    ("weights", ("llada_jax/weights",)),
    ("training", ("llada_jax/training",)),
    ("decoding", ("policies",)),
    ("lowering", ("lowering",)),
    ("runtime", ("llada_jax/backends",)),
    ("api", ("llada_jax",)),
    ("eval", ("eval", "eval/lm_tasks")),
    ("serving", ("llada_jax/server",)),
    ("apps", ("llada_jax/cli",)),
)
# Third-party packages whose function-local imports must be listed below (heavy, or JAX itself).
HEAVY = ("jax", "jaxlib", "iree", "matplotlib", "orbax")
# Every function-local import of a project module or a HEAVY package: (module, imported) -> why it is local.
LOCAL_IMPORTS = {
    ("llada_jax.model.params", "jax.numpy"): "imported by the JAX-free bundle runtime; only init_params needs JAX",
    ("llada_jax.backends.select", "llada_jax.backends.xla"): "select is JAX-free; XLA backends load when a model runs",
    ("llada_jax.backends.select", "llada_jax.backends.xla_staged"): "as backends.xla",
    ("llada_jax.backends.select", "llada_jax.backends.host_side_path"): "JAX, and optional: a phone has none",
    ("llada_jax.backends.iree", "iree.runtime"): "loaded when a bundle is opened, not whenever a backend is selected",
    ("lowering.bundle", "iree.compiler.tools.binaries"): "the compiler, only when a bundle is compiled",
    ("lowering.bundle_weights", "iree.runtime"): "its parameter archive writer, only when a bundle is compiled",
    ("lowering.bundle_module", "iree.compiler"): "the compiler's MLIR bindings, only when a step is exported",
    ("eval.bench", "matplotlib"): "heavy, only for --plot",
    ("eval.bench_kernels", "iree.runtime"): "the IREE rows only, after the XLA ones",
    ("eval.bench_kernels", "iree.compiler"): "as iree.runtime",
    ("eval.bench", "matplotlib.pyplot"): "after matplotlib.use('Agg')",
    ("eval.trace_plot", "matplotlib"): "heavy, only for `llada trace`",
    ("eval.trace_plot", "matplotlib.pyplot"): "after matplotlib.use('Agg')",
    ("llada_jax.cli.serve", "llada_jax.server.app"): "FastAPI loads only for `llada serve`, not every `llada` command",
    ("llada_jax.training.train", "orbax.checkpoint"): "heavy (~0.4 s), only for a training run, not every command",
}
# The bundle runtime runs on a phone: numpy + iree.runtime. Nothing these import at module level, directly or
# through project modules, may be one of JAX_STACK.
JAX_FREE = ("llada_jax.backends.iree", "llada_jax.backends.select",
            "llada_jax.bundle_runner")
JAX_STACK = ("jax", "jaxlib", "optax", "orbax", "iree.compiler")
MAX_FILE_LINES, MAX_FUNCTION_LINES = 350, 60


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str
    imported: str   # a project module, or the dotted name of a third-party import
    line: int
    local: bool     # inside a function: runs when the function is called, not at import


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


MODULES = source_files()


def is_project(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def known_module(name: str) -> str:
    """The longest prefix of `name` that is a project module (`from a.b import c`: a.b.c if c is a module)."""
    parts = name.split(".")
    while ".".join(parts) not in MODULES and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def from_base(importer: str, node: ast.ImportFrom) -> str:
    """The module a `from ... import` names, relative imports resolved against the importer's package."""
    if not node.level:
        return node.module
    package = importer.split(".")
    if MODULES[importer].name != "__init__.py":
        package = package[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def targets(importer: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = from_base(importer, node)
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    return [known_module(name) if is_project(name) else name for name in names]


def imports_of(module: str) -> list[Import]:
    found = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend(Import(module, name, child.lineno, local) for name in targets(module, child))
            visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    tree = ast.parse(MODULES[module].read_text())
    visit(tree, False)
    return found + lazy_exports(module, tree)


def lazy_exports(module: str, tree: ast.Module) -> list[Import]:
    """A package's `_EXPORTS = {name: "module"}` loads those modules on attribute access: imports too."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            found += [Import(module, known_module(value.value), node.lineno, False) for value in node.value.values
                      if isinstance(value, ast.Constant) and is_project(value.value)]
    return found


IMPORTS = [found for module in MODULES for found in imports_of(module)]
PROJECT_IMPORTS = [found for found in IMPORTS if is_project(found.imported)]


def folder_of(module: str) -> str:
    return MODULES[module].parent.relative_to(ROOT).as_posix()


def layers_of(module: str) -> list[str]:
    return [name for name, folders in LAYERS if folder_of(module) in folders]


def rank(layer: str) -> int:
    return [name for name, _ in LAYERS].index(layer)


def where(found: Import) -> str:
    return f"{MODULES[found.importer].relative_to(ROOT)}:{found.line}"


def test_every_folder_is_declared_in_exactly_one_layer():
    declared = [folder for _, folders in LAYERS for folder in folders]
    undeclared = sorted({folder_of(module) for module in MODULES} - set(declared))
    assert not undeclared, f"folders in no layer; declare each in LAYERS (tests/test_layers.py): {undeclared}"
    assert len(declared) == len(set(declared)), f"folders in several layers: {declared}"


def layer_violation(found: Import) -> str | None:
    """Why this import breaks the order, or None."""
    mine, theirs = layers_of(found.importer)[0], layers_of(found.imported)[0]
    if rank(theirs) > rank(mine):
        return f"{mine} may not import the higher layer {theirs}"
    return None


def test_imports_follow_the_layer_order():
    violations = [f"{where(found)}: {found.importer} imports {found.imported}: {reason}" for found in PROJECT_IMPORTS
                  if len(layers_of(found.importer)) == len(layers_of(found.imported)) == 1
                  and (reason := layer_violation(found))]
    assert not violations, "imports against the layer order:\n" + "\n".join(violations)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (or a module importing itself)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_lazy_package_exports_count_as_imports():
    lazy = {found.imported for found in IMPORTS if found.importer == "llada_jax"}
    assert {"llada_jax.api", "llada_jax.weights.loading", "llada_jax.model.config", "llada_jax.system.errors"} <= lazy


def test_cycles_finds_a_cycle_and_only_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["e"]]


def test_no_folder_level_import_cycles():
    graph = {folder_of(module): set() for module in MODULES}
    for found in PROJECT_IMPORTS:
        if folder_of(found.importer) != folder_of(found.imported):
            graph[folder_of(found.importer)].add(folder_of(found.imported))
    assert not cycles(graph), f"import cycles between folders: {cycles(graph)}"


def test_no_file_level_import_cycles():
    graph = {module: set() for module in MODULES}
    for found in PROJECT_IMPORTS:  # function-local imports too: a cycle deferred to call time is still one
        graph[found.importer].add(found.imported)
    assert not cycles(graph), f"import cycles between files: {cycles(graph)}"


def is_heavy(name: str) -> bool:
    return name.split(".")[0] in HEAVY


def test_function_local_imports_only_where_listed():
    local = [found for found in IMPORTS if found.local and (is_project(found.imported) or is_heavy(found.imported))]
    unlisted = [f"{where(found)}: {found.importer} imports {found.imported}" for found in local
                if (found.importer, found.imported) not in LOCAL_IMPORTS]
    stale = set(LOCAL_IMPORTS) - {(found.importer, found.imported) for found in local}
    assert not unlisted, ("function-local imports: move them to the top of the file, or list them in "
                          "LOCAL_IMPORTS with the reason:\n" + "\n".join(unlisted))
    assert not stale, f"LOCAL_IMPORTS entries no longer needed: {sorted(stale)}"


def reaches_jax(root: str) -> list[str]:
    """Module-level imports of JAX_STACK reached from `root` through module-level project imports."""
    seen, todo, found = set(), [root], []
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for imp in (imp for imp in IMPORTS if imp.importer == module and not imp.local):
            if is_project(imp.imported):
                todo.append(imp.imported)
            elif any(imp.imported == name or imp.imported.startswith(name + ".") for name in JAX_STACK):
                found.append(f"{where(imp)}: {module} imports {imp.imported}")
    return found


@pytest.mark.parametrize("module", JAX_FREE)
def test_bundle_runtime_imports_no_jax_at_module_level(module):
    assert not reaches_jax(module), f"{module} must load without JAX:\n" + "\n".join(reaches_jax(module))


@pytest.mark.parametrize("module", ["llada_jax.bundle_runner", "llada_jax.backends.iree"])
def test_bundle_runtime_loads_without_jax(module):
    script = f"import sys, {module}\nprint(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')))"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
    assert proc.stdout.strip() == "[]"


def function_lengths(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def test_files_and_functions_within_size():
    too_long = []
    for path in MODULES.values():
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines > {MAX_FILE_LINES}")
        too_long += [f"{path.relative_to(ROOT)}:{line}: {name} is {length} lines > {MAX_FUNCTION_LINES}"
                     for name, line, length in function_lengths(ast.parse(text)) if length > MAX_FUNCTION_LINES]
    assert not too_long, "split these:\n" + "\n".join(too_long)
