"""The code's shape: no import cycle among the packages' modules, SQLAlchemy only under db/, and scripts/ a
package whose modules run with ``python -m`` from the repository root (no ``sys.path`` edits anywhere).

The import graph is read from the source with `ast` (nothing is imported): an edge A -> B for every
``import B`` / ``from B import x`` in module A, at any depth (a function's deferred import still ties the two
modules together), except under ``if TYPE_CHECKING:``. ``from P import m`` where ``P.m`` is a module is an edge
to ``P.m``; the implicit import of a package's ``__init__`` by its submodules is no edge. A cycle is a strongly
connected component of more than one module (or a module importing itself).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ingest", "engine", "db", "scripts")

def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _import_nodes(tree: ast.AST):
    """Import statements of a module at any depth, leaving out those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _known(name: str, modules) -> str | None:
    """The longest prefix of a dotted name that is one of our modules (None for other libraries)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def imported_names(name: str, path: Path, files) -> set[str]:
    """Absolute dotted names module ``name`` imports: ``import a.b`` gives a.b, ``from a import b`` gives a.b when
    that is one of our modules, else a (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            base = ".".join(anchor[: len(anchor) - (node.level - 1)] + ([base] if base else []))
        out.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the packages it imports."""
    files = module_files()
    return {name: {known for target in imported_names(name, path, files)
                   if (known := _known(target, files)) is not None} for name, path in files.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with a cycle (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph[node]:
                        cycles.append(component)
    return cycles


def test_the_graph_is_read_right():
    """The check sees what it must: a known import of each kind, and a cycle planted in a small graph."""
    graph = import_graph()
    assert "ingest.synth.text" in graph["ingest.synth.doc"]  # from ingest.synth import text as T
    assert "engine.official" in graph["scripts.bench.cpu"]  # a deferred import inside a function
    assert not any(m.startswith(("torch", "sqlalchemy")) for targets in graph.values() for m in targets)
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert sorted(map(sorted, import_cycles(planted))) == [["a", "b", "c"], ["e"]]


def test_no_import_cycle():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


def test_scripts_have_no_import_cycle():
    """Strict for scripts/ whatever the other packages hold."""
    assert not [c for c in import_cycles(import_graph()) if any(m.startswith("scripts") for m in c)]


# The stages of ingest/ and engine/, highest first: a module may import its own stage and any stage of a later
# rank, never a stage of its own rank or an earlier one. A stage is a sub-package, or a top module of its own
# (the four modules every ingest stage uses form one stage). engine/ and db/ sit below all of ingest/.
STAGE_RANKS = [
    ("ingest.commands",),
    ("ingest.calibration",),
    ("ingest.review",),  # the review server writes a corrected document's outputs through the worker's finisher
    ("ingest.worker",),
    ("ingest.outputs", "ingest.quality"),
    ("ingest.reading", "ingest.intake"),
    ("ingest.pages", "ingest.ledger", "ingest.synth"),
    ("ingest (top)",),
    ("engine.loading",),
    ("engine.batch", "engine.chunk_decode"),
    ("engine.chunk_output", "engine.drafters"),
    ("engine.ngram_rule",),
    ("engine.model",),
    ("engine.official", "engine.kernels"),
    ("engine",),
    ("db",),
]
RANK = {stage: rank for rank, stages in enumerate(STAGE_RANKS) for stage in stages}


def stage_of(module: str) -> str:
    """The stage a module belongs to: its sub-package under ingest/ or engine/, else its own top module."""
    parts = module.split(".")
    if parts[0] == "db":
        return "db"
    if parts == ["ingest"]:
        return "ingest (top)"
    if len(parts) == 1:
        return parts[0]
    if parts[0] == "ingest" and f"ingest.{parts[1]}" not in RANK:
        return "ingest (top)"
    return ".".join(parts[:2])


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports between ingest/engine stages that point up or sideways (``a -> b`` with a's rank >= b's)."""
    bad = []
    for module, targets in sorted(graph.items()):
        if not module.startswith(("ingest", "engine")):
            continue
        here = stage_of(module)
        for target in sorted(targets):
            there = stage_of(target)
            if there != here and RANK[there] <= RANK[here]:
                bad.append(f"{module} -> {target} ({here} -> {there})")
    return bad


def test_every_ingest_and_engine_module_has_a_stage():
    unknown = sorted({stage_of(m) for m in import_graph() if m.startswith(("ingest", "engine"))} - set(RANK))
    assert not unknown, f"folders without a rank in STAGE_RANKS: {unknown}"


def test_imports_flow_one_way_between_stages():
    bad = upward_imports(import_graph())
    assert not bad, "imports against the stage order:\n" + "\n".join(bad)


def test_the_stage_check_sees_an_upward_import():
    """A planted import from the pages stage up into the worker, and one between two stages of one rank, are caught."""
    graph = {"ingest.pages.render": {"ingest.worker.worker"}, "ingest.intake.watch": {"ingest.reading.text"},
             "ingest.worker.worker": {"ingest.pages.render", "db.queue"}}
    assert upward_imports(graph) == [
        "ingest.intake.watch -> ingest.reading.text (ingest.intake -> ingest.reading)",
        "ingest.pages.render -> ingest.worker.worker (ingest.pages -> ingest.worker)",
    ]


def test_no_folder_holds_more_than_fifteen_modules():
    counts: dict[Path, int] = {}
    for package in ("ingest", "engine"):
        for path in (ROOT / package).rglob("*.py"):
            counts[path.parent] = counts.get(path.parent, 0) + 1
    crowded = {str(k.relative_to(ROOT)): v for k, v in counts.items() if v > 15}
    assert not crowded, f"folders above 15 modules: {crowded}"


def test_no_module_of_the_packages_above_450_lines():
    """A module that outgrows 450 lines is split along a seam of its own (ingest/, engine/ and db/)."""
    long = {str(path.relative_to(ROOT)): n for name, path in module_files().items() if name.split(".")[0] != "scripts"
            and (n := len(path.read_text(encoding="utf-8").splitlines())) > 450}
    assert not long, f"modules above 450 lines: {long}"


def test_sqlalchemy_only_under_db():
    files = module_files()
    offenders = sorted(name for name, path in files.items() if not name.startswith("db")
                       and any(t.split(".")[0] == "sqlalchemy" for t in imported_names(name, path, files)))
    assert not offenders, f"modules outside db/ importing SQLAlchemy: {offenders}"


def test_config_imports_no_feature_module():
    """The settings know every section's keys and defaults themselves: ingest.config imports only the errors."""
    files = module_files()
    ours = {t for t in imported_names("ingest.config", files["ingest.config"], files) if t in files}
    assert ours <= {"ingest.errors", "ingest"}, f"ingest.config imports {sorted(ours)}"


def test_no_two_product_classes_share_a_name():
    """A class name under ingest/, engine/ and db/ says which class it is: none is defined in two modules."""
    where: dict[str, list[str]] = {}
    for name, path in module_files().items():
        if name.split(".")[0] in ("ingest", "engine", "db"):
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if isinstance(node, ast.ClassDef):
                    where.setdefault(node.name, []).append(name)
    assert not {k: v for k, v in where.items() if len(v) > 1}


def test_no_sys_path_edits():
    """Scripts and tests import the packages normally: no ``sys.path`` edits anywhere."""
    offenders = []
    for path in sorted({*ROOT.glob("tests/**/*.py"), *module_files().values()}):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name)
               and n.value.id == "sys" for n in ast.walk(tree)):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"sys.path used in {offenders}"


def entry_points() -> dict[str, Path]:
    """Modules of scripts/ that run as ``python -m NAME`` (a ``__main__`` guard, or a package's __main__.py)."""
    out = {}
    for name, path in module_files().items():
        if not name.startswith("scripts."):
            continue
        if path.name == "__main__.py":
            out[name.removesuffix(".__main__")] = path
        elif "__name__ == \"__main__\"" in path.read_text(encoding="utf-8"):
            out[name] = path
    return out


def test_script_docstrings_show_their_command():
    """Each script's usage lines are the command that runs it: ``python -m scripts.x.y`` from the repository root."""
    entries = entry_points()
    assert {"scripts.bench.engine", "scripts.train.demo", "scripts.synth"} <= set(entries)
    wrong = {}
    for name, path in entries.items():
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        commands = [ln.strip() for ln in doc.splitlines() if ln.strip().startswith(("python", ".venv/bin/python"))]
        if f"python -m {name}" not in doc or any(f"-m {name}" not in c for c in commands):
            wrong[name] = commands
    assert not wrong, f"usage lines that do not run the module: {wrong}"


def test_scripts_run_as_modules():
    """``python -m NAME --help`` of every script, from the repository root, in one process (runpy does what -m
    does): each imports and answers."""
    driver = (
        "import runpy, sys, warnings\n"
        "warnings.simplefilter('ignore')\n"
        "for name in sys.argv[1:]:\n"
        "    sys.argv = [name, '--help']\n"
        "    try:\n"
        "        runpy.run_module(name, run_name='__main__', alter_sys=True)\n"
        "        code = 0\n"
        "    except SystemExit as exc:\n"
        "        code = exc.code\n"
        "    print('EXIT', name, code, file=sys.stderr)\n"
    )
    names = sorted(entry_points())
    proc = subprocess.run([sys.executable, "-c", driver, *names], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": ""})
    exits = dict(line.split()[1:] for line in proc.stderr.splitlines() if line.startswith("EXIT "))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert exits == {name: "0" for name in names}, proc.stderr[-3000:]
