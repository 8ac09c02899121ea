"""The package's layers: each module imports only modules of its own layer or the layers below
it (imports inside functions included), and the import graph has no circles. Read from the
source with `ast`, so that what an import only reaches at run time counts too."""
import ast
from pathlib import Path

import diffusion_policy_accelerated

PACKAGE = Path(diffusion_policy_accelerated.__file__).resolve().parent
NAME = "diffusion_policy_accelerated"
# Lowest first: the compiled ops and their configuration; the U-Net and schedules; the
# samplers; Diffusion Policy's and LeRobot's adapters; the server; the tools; the command and
# the package's own entry points.
# The compiled library sits beside the package's __init__ and belongs to the kernels layer.
COMPILED = f"{NAME}._C"
LAYERS = ["kernels", "model", "sampling", "adapters", "serving", "tools", "cli", "__main__", ""]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([NAME] + parts)


def imports(path: Path, name: str):
    """The package's modules `path` imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
            found.update(names)
            if not any(n == COMPILED for n in names):  # `from .. import _C` is the library, not the package
                found.add(base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def graph():
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in imports(path, name) if m in modules and m != name} for name, path in modules.items()}


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1] if len(parts) > 1 else "")


def test_each_layer_imports_only_below():
    wrong = [(m, target) for m, targets in graph().items() for target in targets if layer(target) > layer(m)]
    assert not wrong, "imports of a higher layer: " + ", ".join(f"{m} -> {t}" for m, t in sorted(wrong))


def test_no_import_circles():
    edges, state, circles = graph(), {}, []

    def visit(node, path):
        state[node] = "open"
        for target in sorted(edges[node]):
            if state.get(target) == "open":
                circles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_every_module_has_a_layer():
    for module in graph():
        layer(module)  # raises ValueError for a module outside LAYERS
