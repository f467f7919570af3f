"""The package's layout rules, read from the source: who may import whom.

The core is a few rooms with one-way imports (CONTRIBUTING.md draws them). From the bottom:

- ``errors`` and ``contracts``, the leaves: they import nothing of ours;
- ``runtime/``: what runs a stage;
- ``cost/``: what a partition costs (the measurement, the solver, the cost and memory model);
- ``plan/``: what a plan says;
- ``engine/``: what every engine shares;
- the root's other modules (dialect, plugins, ...) and sub-packages (planner, testing, ...).

A module imports only from its own layer and the layers below it. Every import counts: at the
top level, inside functions and inside ``if TYPE_CHECKING:`` blocks (a cycle that only the type
checker follows is still one a reader has to hold in mind), and importing ``a.b.c`` also
imports the package ``a.b`` (its ``__init__``), as Python does. On that graph:

- no import cycle among the core modules;
- the leaves import nothing of ours;
- no dialect imports another dialect, and a built-in dialect imports of the core only
  ``pipedialect.sdk`` (the module dialects are written with), ``pipedialect.contracts``,
  ``pipedialect.errors`` and the package root: it uses only what a third party imports, from
  where a third party imports it; no core module imports ``pipedialect.sdk``, which sits above
  every room as the dialects do;
- the example third-party dialect and the dialect of docs/write-a-dialect.rst import nothing of
  pipedialect but ``pipedialect.sdk``;
- the package root is plain imports: ``partition`` and ``trace`` stay the functions whatever
  is imported first. (That pytest never loads the suite's plugin unasked is checked from a real
  install, in test_packaging.py.)

Cost lives in one room: ``pipedialect.cost`` holds the one measurement of a model, the exact
solver, the schedule programs, the simulator and the cost and memory model, and every bubble
formula. ``partition(balance=)``, the planner and the trace import it; no module outside it
imports its private modules, measures FLOPs, or computes a bubble itself (a function named for
the bubble outside the room divides nothing: it calls the room's).

And the core reads an engine only through what the contracts declare: no core module calls
``getattr``, ``hasattr``, ``setattr``, ``delattr`` or ``vars`` on an engine (a name or attribute
called ``engine`` or ending in ``_engine``, or one annotated with an engine type), so a feature
that needs something of an engine asks for it through a protocol, a capability or a Dialect hook.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import _doc_examples
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"pipedialect": ROOT / "core", "pipedialect.dialects": ROOT / "dialects"}


def _modules() -> dict[str, tuple[Path, bool]]:
    found: dict[str, tuple[Path, bool]] = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            if "build" in path.relative_to(ROOT).parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            found[".".join([package, *parts])] = (path, is_package)
    return found


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The project modules ``name`` imports anywhere (top level, functions, TYPE_CHECKING).

    ``from package import name`` counts as importing the submodule when ``name`` is one, else
    as importing the package itself (its ``__init__``). Importing a module also imports each
    package above it that ``name`` is not itself inside (that one is already being imported).
    """
    path, is_package = MODULES[name]
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                if f"{module}.{alias.name}" in MODULES:
                    out.add(f"{module}.{alias.name}")
                elif module in MODULES:
                    out.add(module)
    own = set(_packages_above(name)) | ({name} if is_package else set())
    out |= {pkg for target in out for pkg in _packages_above(target) if pkg not in own}
    out.discard(name)
    return out


def _packages_above(name: str) -> list[str]:
    """The packages ``name`` lies in, as far up as the project's own: a.b.c -> a.b, a."""
    parts = name.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in MODULES]


#: The core's layers, bottom first: a module imports only from its own layer and those below.
LEAVES = ("pipedialect.errors", "pipedialect.contracts")
ROOMS = ("pipedialect.runtime", "pipedialect.cost", "pipedialect.plan", "pipedialect.engine")


def _layer(name: str) -> int:
    """0 for a leaf, 1.. for the rooms, and one above them for every other core module."""
    if name in LEAVES:
        return 0
    for level, room in enumerate(ROOMS, start=1):
        if name == room or name.startswith(room + "."):
            return level
    return len(ROOMS) + 1


def _is_core(name: str) -> bool:
    return not name.startswith("pipedialect.dialects")


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (a list of nodes, first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_the_rules_see_the_real_modules() -> None:
    """The graph below is built from the actual files (so an empty graph cannot pass)."""
    assert {"pipedialect.contracts", "pipedialect.dialect", "pipedialect.runtime.stage"} <= set(
        MODULES
    )
    assert "pipedialect.contracts" in _imports("pipedialect.runtime.stage")
    assert "pipedialect.runtime.stage" in _imports("pipedialect.plan.ties")  # a top-level import
    # importing a module imports its package too, but not the package the importer is in
    assert "pipedialect.runtime" in _imports("pipedialect.plan.ties")
    assert "pipedialect.plan" not in _imports("pipedialect.plan.ties")
    # an import only the type checker runs is seen: hookspecs names Dialect in annotations only
    assert "pipedialect.dialect" in _imports("pipedialect.hookspecs")
    # a function-level import is seen: the torch engine builds its stages inside methods
    assert any(
        m.startswith("pipedialect.dialects.torch.") for m in _imports("pipedialect.dialects.torch")
    )


def test_no_import_cycle_among_core_modules() -> None:
    # A module importing its own package's __init__ is a cycle when that __init__ imports it
    # back: the package __init__ is a node like any other here.
    graph = {name: {m for m in _imports(name) if _is_core(m)} for name in MODULES if _is_core(name)}
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_rooms_import_only_downwards() -> None:
    assert all(room in MODULES for room in ROOMS)
    problems = [
        f"{name} (layer {_layer(name)}) imports {target} (layer {_layer(target)})"
        for name in MODULES
        if _is_core(name)
        for target in sorted(_imports(name))
        if _is_core(target) and _layer(target) > _layer(name)
    ]
    assert problems == []


def test_the_leaves_import_nothing_of_ours() -> None:
    """contracts holds the value types and protocols; errors the exceptions: nothing else."""
    assert {leaf: _imports(leaf) for leaf in LEAVES} == {leaf: set() for leaf in LEAVES}


#: What a built-in dialect may import of the core: the dialect authors' module, the two leaves
#: and the package root.
DIALECT_MAY_IMPORT = frozenset(
    {"pipedialect", "pipedialect.sdk", "pipedialect.contracts", "pipedialect.errors"}
)
SDK = "pipedialect.sdk"


def dialect_import_problems(name: str, imports: set[str]) -> list[str]:
    """What is wrong with dialect module ``name`` importing ``imports`` (project modules)."""
    own = name.split(".")[2]
    problems = []
    for target in sorted(imports):
        tparts = target.split(".")
        if tparts[:2] == ["pipedialect", "dialects"]:
            if len(tparts) > 2 and tparts[2] != own:
                problems.append(f"{name} imports another dialect: {target}")
        elif target not in DIALECT_MAY_IMPORT:
            problems.append(f"{name} imports {target}: import it from {SDK}")
    return problems


def test_the_dialect_rule_sees_each_form() -> None:
    """The rule flags a core room, a private module and another dialect, and nothing else; and
    the real graph shows a dialect importing the SDK (so an empty graph cannot pass)."""
    name = "pipedialect.dialects.torch.engine"
    imports = {
        "pipedialect",
        "pipedialect.sdk",
        "pipedialect.contracts",
        "pipedialect.errors",
        "pipedialect.dialects",
        "pipedialect.dialects.torch._ties",
        "pipedialect.dialects.local",
        "pipedialect.runtime.agreement",
        "pipedialect.engine._base",
        "pipedialect.dialect",
    }
    assert dialect_import_problems(name, imports) == [
        f"{name} imports pipedialect.dialect: import it from {SDK}",
        f"{name} imports another dialect: pipedialect.dialects.local",
        f"{name} imports pipedialect.engine._base: import it from {SDK}",
        f"{name} imports pipedialect.runtime.agreement: import it from {SDK}",
    ]
    assert SDK in _imports("pipedialect.dialects.torch._ties")
    assert SDK in _imports("pipedialect.dialects.local._plugin")  # a function-level import too
    assert SDK in MODULES


def test_a_dialect_imports_only_the_sdk_the_leaves_and_the_root() -> None:
    problems = [
        problem
        for name in MODULES
        if len(name.split(".")) > 2 and name.split(".")[1] == "dialects"
        for problem in dialect_import_problems(name, _imports(name))
    ]
    assert problems == []


def test_no_core_module_imports_the_sdk() -> None:
    assert [name for name in MODULES if _is_core(name) and SDK in _imports(name)] == []


def _pipedialect_imports(source: str) -> set[str]:
    """Every ``pipedialect`` module ``source`` imports (``import x`` or ``from x import``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "pipedialect")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.update({node.module} if node.module.split(".")[0] == "pipedialect" else ())
    return found


def test_the_third_party_dialects_import_only_the_sdk() -> None:
    """The example distribution's package and the page's ``mine`` package (not their tests,
    which import the conformance suite)."""
    assert _pipedialect_imports("import pipedialect\nfrom pipedialect.plan import x\n") == {
        "pipedialect",
        "pipedialect.plan",
    }
    example = ROOT / "examples" / "pipedialect-sendrecv" / "pipedialect_sendrecv"
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in sorted(example.glob("*.py"))}
    page = ROOT / "docs" / "write-a-dialect.rst"
    files = _doc_examples.collect().files[page]
    sources.update(
        {
            f"{page.name}: {path}": code
            for path, code in files.items()
            if path.endswith(".py") and path.startswith("mine/")
        }
    )
    assert len(sources) >= 5, sorted(sources)
    found = {where: _pipedialect_imports(code) for where, code in sources.items()}
    assert found == {where: {SDK} for where in sources}


def test_the_sdk_exports_every_contract_and_error_and_a_sorted_all() -> None:
    from pipedialect import contracts, errors, sdk

    assert set(contracts.__all__) | set(errors.__all__) <= set(sdk.__all__)
    assert sdk.__all__ == sorted(sdk.__all__)
    assert all(hasattr(sdk, name) for name in sdk.__all__)


@pytest.mark.distributed
def test_partition_and_trace_stay_functions_in_every_import_order() -> None:
    """``pipedialect.partition`` is a function even after its submodule is imported."""
    code = (
        "import pipedialect.plan.partition, pipedialect.trace, pipedialect\n"
        "import pipedialect.dialects.local\n"
        "assert callable(pipedialect.partition) and callable(pipedialect.trace)\n"
        "from pipedialect.plan.partition import PipelinePlan\n"
        "assert pipedialect.PipelinePlan is PipelinePlan\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_package_root_exports_every_error_and_a_sorted_all() -> None:
    import pipedialect
    from pipedialect import errors

    assert set(errors.__all__) <= set(pipedialect.__all__)
    assert pipedialect.__all__ == sorted(pipedialect.__all__)
    assert all(hasattr(pipedialect, name) for name in pipedialect.__all__)


#: The builtins that read or write an object's attributes by name.
PROBES = ("getattr", "hasattr", "setattr", "delattr", "vars")


def _is_engine_type(annotation: ast.expr | None) -> bool:
    """An annotation naming an engine type (``RuntimeEngine``, ``CheckpointingEngine``, ...)."""
    if annotation is None:
        return False
    words = re.findall(r"\w+", ast.unparse(annotation))  # a quoted annotation too
    return any(word.endswith("Engine") for word in words)


def _is_engine_name(name: str) -> bool:
    return name == "engine" or name.endswith("_engine")


def engine_probes(source: str) -> list[str]:
    """``"line: call"`` for every attribute probe on an engine in ``source`` (see the module's
    docstring for what counts as an engine)."""
    tree = ast.parse(source)
    typed: dict[ast.AST, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            args = node.args
            every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
            names = {a.arg for a in every if a is not None and _is_engine_type(a.annotation)}
            for inner in ast.walk(node):
                if (
                    isinstance(inner, ast.AnnAssign)
                    and isinstance(inner.target, ast.Name)
                    and _is_engine_type(inner.annotation)
                ):
                    names.add(inner.target.id)
            typed[node] = names
    engines_in: dict[ast.AST, set[str]] = {}
    for function, names in typed.items():
        for inner in ast.walk(function):
            engines_in.setdefault(inner, set()).update(names)
    found = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in PROBES
            and node.args
        ):
            continue
        target = node.args[0]
        if isinstance(target, ast.Name):
            name = target.id
            engine = _is_engine_name(name) or name in engines_in.get(node, set())
        elif isinstance(target, ast.Attribute):
            engine = _is_engine_name(target.attr)
        else:
            engine = False
        if engine:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_engine_probe_rule_sees_each_form() -> None:
    """The rule below flags each way of probing an engine, and nothing else."""
    source = textwrap.dedent(
        """
        def f(engine, held, runtime_engine, other):
            getattr(engine, "save_checkpoint", None)
            hasattr(held.engine, "module")
            setattr(runtime_engine, "global_steps", 3)
            delattr(self.engine, "x")
            vars(engine)
            getattr(other, "x")
            getattr(held, "engine")
            held.engine.train_batch

        def g(e: "RuntimeEngine", m: "Any") -> None:
            getattr(e, "optimizer")
            getattr(m, "optimizer")
            x: CheckpointingEngine | None = None
            hasattr(x, "load_checkpoint")
        """
    )
    flagged = [line.split(": ", 1)[1] for line in engine_probes(source)]
    assert flagged == [
        "getattr(engine, 'save_checkpoint', None)",
        "hasattr(held.engine, 'module')",
        "setattr(runtime_engine, 'global_steps', 3)",
        "delattr(self.engine, 'x')",
        "vars(engine)",
        "getattr(e, 'optimizer')",
        "hasattr(x, 'load_checkpoint')",
    ]


def test_the_core_never_probes_an_engine_by_attribute_name() -> None:
    problems = [
        f"{path.relative_to(ROOT)}:{probe}"
        for name, (path, _) in sorted(MODULES.items())
        if _is_core(name)
        for probe in engine_probes(path.read_text())
    ]
    assert problems == []


COST = "pipedialect.cost"


def _in_cost_room(name: str) -> bool:
    return name == COST or name.startswith(COST + ".")


def bubble_arithmetic(source: str) -> list[str]:
    """``"line: function"`` for every function named for the bubble that divides in its body
    (a bubble computed in place rather than asked of the cost room)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if "bubble" not in node.name.lower():
            continue
        if any(
            isinstance(inner, ast.BinOp | ast.AugAssign) and isinstance(inner.op, ast.Div)
            for inner in ast.walk(node)
        ):
            found.append(f"{node.lineno}: {node.name}")
    return found


def test_the_cost_rule_sees_each_form() -> None:
    """The bubble rule flags a division, in place or augmented, and nothing else; the graph
    shows each user of the cost room importing it (so an empty graph cannot pass)."""
    source = textwrap.dedent(
        """
        def bubble(busy, window):
            return 1 - busy / window

        def theoretical_bubble(p, m):
            x = p - 1
            x /= m + p - 1
            return x

        def bubble_of(spans):
            return idle_fractions(spans)

        def describe(p, m):
            return (p - 1) / (m + p - 1)
        """
    )
    assert [line.split(": ")[1] for line in bubble_arithmetic(source)] == [
        "bubble",
        "theoretical_bubble",
    ]
    for user in ("pipedialect.plan.partition", "pipedialect.trace", "pipedialect.planner._search"):
        assert COST in _imports(user), user
    assert _layer("pipedialect.cost._simulate") < _layer("pipedialect.plan.partition")


def test_cost_lives_in_one_room() -> None:
    private = [
        f"{name} imports {target}"
        for name in sorted(MODULES)
        if _is_core(name) and not _in_cost_room(name)
        for target in sorted(_imports(name))
        if _in_cost_room(target) and target.split(".")[-1].startswith("_")
    ]
    assert private == []
    measuring = [
        name
        for name, (path, _) in sorted(MODULES.items())
        if not _in_cost_room(name) and "flop_counter" in path.read_text()
    ]
    assert measuring == []
    formulas = [
        f"{path.relative_to(ROOT)}:{where}"
        for name, (path, _) in sorted(MODULES.items())
        if _is_core(name) and not _in_cost_room(name)
        for where in bubble_arithmetic(path.read_text())
    ]
    assert formulas == []
