"""The house's floors, checked on the import graph of the package's source (every import
statement, also inside functions; annotations under TYPE_CHECKING do not run and are left
out): no module imports another that imports it back, however far round, and every import
between packages points down docs/architecture.md's table of floors, which is this test's
source (config/ the bottom floor: it imports nothing of ours outside config/). The doc's
module map names every module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "titan_learner"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(tree: ast.Module) -> list[ast.stmt]:
    typing_only = {
        id(node)
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If) and ast.unparse(branch.test).endswith("TYPE_CHECKING")
        for statement in branch.body
        for node in ast.walk(statement)
    }
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in typing_only
    ]


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (`from a import b` counts a.b when b is a
    module, else a)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif node.level == 0 and node.module:
                targets = [
                    f"{node.module}.{alias.name}"
                    if f"{node.module}.{alias.name}" in modules
                    else node.module
                    for alias in node.names
                ]
            else:
                targets = []
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_round_a_cycle():
    assert cycles(import_graph()) == []


def test_config_is_the_bottom_floor():
    upward = {
        (name, target)
        for name, targets in import_graph().items()
        if name.startswith("titan_learner.config")
        for target in targets
        if not target.startswith("titan_learner.config")
    }
    assert upward == set()


def test_the_graph_sees_imports_inside_functions():
    """A check on a graph that missed lazy imports could not fail: the job's lazy imports of
    the vLLM family must be in it."""
    assert "titan_learner.vllm.build" in import_graph()["titan_learner.job.grpo"]


def unit(module: str) -> str:
    """The package (or top-level module) a module belongs to: its floor's name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def floors() -> dict[str, int]:
    """docs/architecture.md's table of floors: package or module name -> floor."""
    lines = ARCHITECTURE.read_text().splitlines()
    start = lines.index("| floor | packages and modules | what they are |")
    table: dict[str, int] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        floor, names = line.split(" | ")[:2]
        for name in re.findall(r"`([\w.]+)`", names):
            assert name not in table, f"{name} is on two floors"
            table[name] = int(floor.removeprefix("| "))
    return table


def test_the_floors_table_names_every_package():
    units = {unit(module) for module in import_graph()}
    assert set(floors()) == units, "docs/architecture.md's floors must name each package once"


def test_every_import_between_packages_points_down():
    floor = floors()
    upward = sorted(
        f"{name} -> {target} (floor {floor[unit(name)]} -> {floor[unit(target)]})"
        for name, targets in import_graph().items()
        for target in targets
        if unit(name) != unit(target) and floor[unit(target)] >= floor[unit(name)]
    )
    assert upward == [], "imports that do not point down docs/architecture.md's floors"


def test_config_weights_and_rollout_import_neither_job_nor_vllm():
    """Issue 40's done-when, said plainly (the floors imply it)."""
    upward = {
        (name, target)
        for name, targets in import_graph().items()
        if unit(name) in {"config", "weights", "rollout"}
        for target in targets
        if unit(target) in {"job", "vllm"}
    }
    assert upward == set()


def test_the_module_map_names_every_module():
    """Each module by its path under titan_learner/ (or its folder's row, as `rollout/`);
    packages' __init__.py files are their folders."""
    text = ARCHITECTURE.read_text()
    module_map = text[text.index("## Module map") :].split("\n## ")[0]
    named = set(re.findall(r"`([\w/]+(?:\.py|/))`", module_map))
    unnamed = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py"
        and str(path.relative_to(PACKAGE)) not in named
        and f"{path.relative_to(PACKAGE).parts[0]}/" not in named
    )
    assert unnamed == [], "add a row to docs/architecture.md's module map"


def test_the_learner_contract_stays_a_facade():
    """Issue 40's done-when: learner/contract.py under 250 lines; what the stepper calls back
    lives in learner/step.py, the state in learner/state.py, the parts in sub-packages."""
    lines = len((PACKAGE / "learner" / "contract.py").read_text().splitlines())
    assert lines < 250, f"learner/contract.py has {lines} lines; move a concern out of it"


def test_only_the_vllm_package_imports_vllm():
    """vLLM is imported by titan_learner.vllm alone (issue 63): every other package reaches
    it through that package, whatever the import (also inside functions)."""
    outside = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] == "vllm":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            if any(name.split(".")[0] == "vllm" for name in names):
                outside.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert outside == [], "import vLLM in titan_learner/vllm/ and call that from here"
