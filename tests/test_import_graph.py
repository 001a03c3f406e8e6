"""The import graph of the package, read from the source (function-level imports included,
annotation-only ones not): no cycles, and no import against the layering in docs/architecture.md:

    common  <-  kernels  <-  services (api, tokenizer, scheduler, worker, engine, ...)  <-  tools

The four processes never import each other; only the in-process engine composes them, and the
launcher reads their settings modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The folders that install as stoker.<folder> (setup.py), and stoker/ itself (the command).
MAPPED = ("common", "kernels", "services", "tools")
ROOTS = (*MAPPED, "stoker")
PROCESSES = ("api", "tokenizer", "scheduler", "worker")
# Who may import each process's modules, besides the process itself.
PROCESS_USERS = {
    "scheduler": ("engine",),  # the offline engine runs the scheduler core in-process
    "worker": ("engine",),  # and the worker's model runner
    "tokenizer": ("engine",),  # and the detokenizer
    "api": (),
}
# `stoker serve` starts every process: it reads each one's settings (services/<process>/config.py,
# light modules), and nothing else of them.
COMPOSERS = ("stoker.launcher",)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _strip(name: str) -> str:
    """stoker.services.x -> services.x: the module's folder name, as _module_name gives it."""
    head, _, rest = name.partition(".")
    return rest if head == "stoker" and rest.split(".")[0] in MAPPED else name


def _imports(path: Path, module: str) -> set[str]:
    """Modules (within ROOTS) that `path` imports anywhere in its body."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    # Imports for annotations only (`if TYPE_CHECKING:`) never run: not edges.
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING")
        for stmt in block.body
        for n in ast.walk(stmt)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [_strip(a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = _strip(node.module or "")
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in ROOTS)
    return found


def _graph() -> dict[str, set[str]]:
    files = [p for root in ROOTS for p in (REPO / root).rglob("*.py") if (REPO / root).is_dir()]
    modules = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        # An import names a module, or a name inside one: resolve to the longest module.
        edges = set()
        for target in _imports(path, name):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def _component(module: str) -> tuple[str, str]:
    parts = module.split(".")
    return parts[0], parts[1] if len(parts) > 1 else ""


def _may_use(module: str, target: str) -> bool:
    """Whether `module` may import `target`, a module of one of the four processes. Tools
    (training reuses the worker's EAGLE network) and the command line may."""
    root, sub = _component(module)
    process = _component(target)[1]
    if module in COMPOSERS:
        return target == f"services.{process}.config"
    return root != "services" or sub == process or sub in PROCESS_USERS[process]


def test_the_graph_covers_the_package():
    graph = _graph()
    assert "services.scheduler.scheduler" in graph and "common.messages" in graph
    assert graph["services.scheduler.scheduler"] >= {"services.scheduler.steady"}


def test_no_import_cycles():
    graph = _graph()
    # Package __init__ files re-export their children; an edge from a package to its own
    # submodule is not a cycle risk (Python imports the package first).
    def edges(m: str) -> set[str]:
        return {t for t in graph[m] if not t.startswith(m + ".")}

    state: dict[str, int] = {}  # 1: on the stack, 2: done
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for t in edges(m):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t) :] + [t])
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_upward_imports():
    allowed_roots = {
        "common": {"common"},
        "kernels": {"kernels", "common"},
        "services": {"services", "kernels", "common"},
        "tools": {"tools", "services", "kernels", "common"},
        "stoker": {"stoker", "tools", "services", "kernels", "common"},
    }
    bad = []
    for module, targets in _graph().items():
        root, sub = _component(module)
        for target in targets:
            troot, tsub = _component(target)
            if troot not in allowed_roots[root]:
                bad.append(f"{module} -> {target} ({root} may not import {troot})")
            elif troot == "services" and tsub in PROCESSES and not _may_use(module, target):
                bad.append(f"{module} -> {target} (only {tsub} and the engine import it)")
    assert not bad, "\n".join(sorted(bad))
