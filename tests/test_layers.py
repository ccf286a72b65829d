"""The layers of shard/ as its imports draw them: no import loop, and none crosses from one subpackage (or
top-level module) into another, counting the imports made inside functions and the package
__init__ that every import of a submodule runs first; no Rockchip chip is named outside
shard/targets/."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent / "shard"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(node: ast.AST, package: str) -> list[str]:
    """The modules an import statement names (a `from` import's names too: they may be modules)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:   # relative: from its package up
        up = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([node.module] if node.module else []))
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def import_graph() -> nx.DiGraph:
    """shard's modules, an edge for each import anywhere in a file (functions included), and from each
    module to the packages above what it imports (Python runs their __init__ first)."""
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = nx.DiGraph()
    for name, path in files.items():
        graph.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            for target in imported(node, package):
                while target and target not in files:   # a name inside a module: the module
                    target = target.rpartition(".")[0]
                parents = target.split(".")
                for k in range(2, len(parents) + 1):
                    dotted = ".".join(parents[:k])
                    if dotted != name and dotted in files and not name.startswith(dotted + "."):
                        graph.add_edge(name, dotted)
    return graph


def layer(module: str) -> str:
    """shard.passes.partition -> passes; shard.calibration -> calibration."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def crossing_loops(graph: nx.DiGraph) -> list[str]:
    """One cycle of each import loop whose modules lie in more than one layer."""
    crossing = []
    for loop in nx.strongly_connected_components(graph):
        if len({layer(m) for m in loop}) > 1:
            cycle = nx.find_cycle(graph.subgraph(loop))
            crossing.append(" -> ".join([a for a, _ in cycle] + [cycle[0][0]]))
    return crossing


def test_no_import_loop_crosses_a_subpackage_or_stays_inside_one():
    graph = import_graph()
    assert graph.number_of_nodes() > 50 and graph.has_edge("shard.compilation.stages", "shard.passes")
    loops = crossing_loops(graph)
    assert not loops, "import loops across subpackages:\n" + "\n".join(loops)
    inside = [sorted(loop) for loop in nx.strongly_connected_components(graph) if len(loop) > 1]
    assert not inside, f"import loops (type-checking imports count too): {inside}"


def test_the_check_finds_a_loop_made_in_a_function_or_through_a_package(tmp_path, monkeypatch):
    # The check itself, on a small tree: a loop held apart only by an import inside a function counts,
    # and so does one through the __init__ of the package a submodule import runs first.
    tree = tmp_path / "shard"
    (tree / "a").mkdir(parents=True)
    (tree / "__init__.py").write_text("")
    (tree / "a" / "__init__.py").write_text("def f():\n    from shard import c\n")
    (tree / "a" / "x.py").write_text("from shard.b import y\n")
    (tree / "b.py").write_text("def f():\n    from shard.a.x import g\n")
    (tree / "c.py").write_text("")
    (tree / "d.py").write_text("from shard.a.x import g\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tree)
    assert crossing_loops(import_graph()) == ["shard.a.x -> shard.b -> shard.a.x"] or \
        crossing_loops(import_graph()) == ["shard.b -> shard.a.x -> shard.b"]
    (tree / "c.py").write_text("import shard.d\n")   # a.x -> a (its package) -> c -> d -> a.x
    assert len(crossing_loops(import_graph())) == 1 and "shard.d" in crossing_loops(import_graph())[0]


CHIPS = re.compile(r"\b(rk|rv)\d{4}[a-z]?\b", re.IGNORECASE)


def literals(path: Path):
    """The string constants of a file that are not docstrings, with their line numbers."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def test_no_chip_is_named_outside_the_targets():
    named = [f"{path.relative_to(ROOT.parent)}:{line}: {text!r}"
             for path in sorted(ROOT.rglob("*.py")) if "targets" not in path.relative_to(ROOT).parts
             for line, text in literals(path) if CHIPS.search(text)]
    assert not named, "chip names outside shard/targets/:\n" + "\n".join(named)


# What the Rockchip toolkit's log calls things: a build figure in the compile's own words elsewhere
# (shard.targets.ShardBuild: overflow_lines, fallbacks; Target.words says them back to the user)
VENDOR_LOG_TERMS = re.compile(r"regtask|single_core|E RKNN", re.IGNORECASE)


def names_and_literals(path: Path):
    """(line, text) of every name, attribute, argument, keyword and non-docstring string constant of a file."""
    tree = ast.parse(path.read_text())
    yield from literals(path)
    for node in ast.walk(tree):
        name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                else node.arg if isinstance(node, (ast.arg, ast.keyword)) else None)
        if name:
            yield node.lineno, name


def test_no_term_of_the_vendor_log_is_read_outside_its_target():
    """The measured axes, the reports, the summary and the passes' failure classes speak in common words;
    only shard/targets/rknn/ (and the toolkit's own executors) read the toolkit's log."""
    named = [f"{path.relative_to(ROOT.parent)}:{line}: {text!r}" for path in sorted(ROOT.rglob("*.py"))
             if "rknn" not in path.relative_to(ROOT).parts and not path.name.startswith("rknn_")
             for line, text in names_and_literals(path) if VENDOR_LOG_TERMS.search(text)]
    assert not named, "the vendor log's terms outside shard/targets/rknn/:\n" + "\n".join(named)


def test_the_vendor_log_check_finds_a_term_in_a_name_or_a_string(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('"""REGTASK in a docstring is prose."""\nx = {"regtask_lines": 0}\ny = x.single_core_fallbacks\n')
    assert [text for _, text in names_and_literals(path) if VENDOR_LOG_TERMS.search(text)] == \
        ["regtask_lines", "single_core_fallbacks"]


def functions(root: Path):
    """(path, function node) for every function and method under root."""
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path, node


def test_no_function_is_over_60_lines():
    long = [f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
            for path, node in functions(ROOT) if node.end_lineno - node.lineno >= 60]
    assert not long, "\n".join(long)


def hidden_imports(root: Path) -> list[str]:
    """Each import of a shard module made inside a function under root (nested functions once)."""
    seen, found = set(), []
    for path, function in functions(root):
        for node in ast.walk(function):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and (path, node.lineno) not in seen:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if getattr(node, "level", 0) or any(n == "shard" or n.startswith("shard.") for n in names):
                    seen.add((path, node.lineno))
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {function.name}")
    return found


def test_few_imports_of_shard_modules_hide_inside_functions(tmp_path):
    """An import inside a function hides a dependency (it once hid a loop across four packages): at
    most 20 of shard's own modules are imported so, each one a module that brings torch."""
    hidden = hidden_imports(ROOT)
    assert len(hidden) <= 20, "\n".join(hidden)
    (tmp_path / "shard").mkdir()   # the count itself, on a small tree
    (tmp_path / "shard" / "m.py").write_text("import os\nfrom shard import a\n\ndef f():\n    import json\n"
                                             "    from shard.b import c\n\n    def g():\n        from . import d\n")
    assert [h.rpartition(" ")[0] for h in hidden_imports(tmp_path / "shard")] == ["shard/m.py:6", "shard/m.py:9"]


@pytest.mark.toolkit
def test_the_rknn_executors_import_where_only_numpy_and_the_toolkit_are():
    """The runtime's simulator and board executors import in the toolkit's own environment, whose
    numpy and onnx are the toolkit's pins and which holds none of the compiler's libraries; nothing
    of the compiler comes with them (an import of shard.targets.rknn's package once brought the passes)."""
    from shard.targets.rknn.env import find_python

    code = (f"import sys; sys.path.insert(0, {str(ROOT.parent)!r}); "
            "import shard.runtime.executors.rknn_sim, shard.runtime.executors.rknn_board; "
            "print(' '.join(sorted(sys.modules)))")
    run = subprocess.run([str(find_python("rk3588")), "-I", "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    modules = set(run.stdout.split())
    assert "shard.runtime.executors.rknn_sim" in modules
    compiler = {"onnx_graphsurgeon", "networkx", "onnxruntime", "torch", "shard.passes", "shard.compilation",
                "shard.targets.rknn.target"}
    assert not modules & compiler, sorted(modules & compiler)


def key_reads(path: Path, bases: tuple[str, ...]) -> list[str]:
    """Reads of a report by a key written in the code (`x.report["totals"]`, `reports.get("partition")`) in
    one file, where the report's name ends in one of `bases`: a subscript or .get() that is not the
    target of an assignment, nor the object of an .append/.update/.extend (a write)."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def named(node) -> bool:
        return isinstance(node, (ast.Name, ast.Attribute)) and ast.unparse(node).endswith(bases)

    def written(node) -> bool:
        up = parents.get(node)
        return (isinstance(up, ast.Subscript) and isinstance(up.ctx, ast.Store) or isinstance(up, ast.AugAssign)
                or isinstance(up, ast.Attribute) and up.attr in ("append", "update", "extend", "setdefault"))

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and named(node.value) \
                and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str) and not written(node):
            found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and named(node.func.value) and node.args and isinstance(node.args[0], ast.Constant):
            found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    return found


def test_reports_are_read_through_their_typed_records():
    """A compile's report and its passes' reports are read by key only where they are written (the
    passes, shard/compilation/) and in shard.summary, which reads them into typed records: everywhere
    else (the CLI, inspect, the runtime) reads fields. Inside shard/compilation/ no stage reads a pass's
    report by key (shard.summary.passed, cut_of, stages_of, fp8_nodes)."""
    makers = {ROOT / "summary.py"} | set((ROOT / "passes").rglob("*.py")) | set((ROOT / "compilation").rglob("*.py"))
    reads = [hit for path in sorted(ROOT.rglob("*.py")) if path not in makers
             for hit in key_reads(path, ("report", "reports"))]
    reads += [hit for path in sorted((ROOT / "compilation").rglob("*.py")) for hit in key_reads(path, ("ctx.reports",))]
    assert not reads, "reports read by key:\n" + "\n".join(reads)


def test_the_readme_is_short_lists_and_short_cells():
    """The README says what each command does in short (table cells of at most 400 characters, list items
    of at most 200); what each option does is in docs/COMMANDS.md, which every command's entry links to."""
    readme = (ROOT.parent / "README.md").read_text()
    cells = [cell for line in readme.splitlines() if line.startswith("|") for cell in line.split("|")]
    items = [line for line in readme.splitlines() if line.startswith("- ")]
    assert cells and items and max(map(len, cells)) <= 400 and max(map(len, items)) <= 200
    commands = (ROOT.parent / "docs" / "COMMANDS.md").read_text()
    for anchor in set(re.findall(r"docs/COMMANDS\.md#([a-z-]+)", readme)):
        assert f"\n## {anchor.replace('-', ' ')}" in commands.lower(), anchor


def test_the_passes_and_the_executors_keep_to_their_sides():
    """The passes import nothing of the runtime: the ops a host step may hold are the bundle format's
    (shard.bundle.HOST_ONNX_OPS), and what runs a replica faster (torch on the GPU) the target hands
    them (PassContext.replica). The runtime's executors import nothing of the compiler: of
    shard.targets, only the toolkit's client (the simulator runs in its worker)."""
    graph = import_graph()
    crossing = [f"{a} -> {b}" for a, b in graph.edges if a.startswith("shard.passes") and b.startswith("shard.runtime")]
    crossing += [f"{a} -> {b}" for a, b in graph.edges if a.startswith("shard.runtime.executors")
                 and b.startswith(("shard.passes", "shard.compilation", "shard.probes", "shard.targets.rknn.target",
                                   "shard.targets.gpu", "shard.targets.registry"))]
    assert not crossing, "\n".join(crossing)


def test_the_compiler_reaches_the_vendor_through_the_target():
    """Outside shard/targets/, only the command line (`shard toolkit`, the probe cache, runs on a board's
    node) and the runtime's own executors of the toolkit import shard.targets.rknn: the compile, the
    passes and the probe ask the Target (edge layouts, opsets, the probe's toolkit)."""
    graph = import_graph()
    side_doors = [f"{a} -> {b}" for a, b in graph.edges if b.startswith("shard.targets.rknn")
                  and not a.startswith(("shard.targets", "shard.cli.", "shard.runtime.executors.rknn_"))]
    assert graph.has_edge("shard.runtime.executors.rknn_sim", "shard.targets.rknn.simulate")
    assert not side_doors, "\n".join(side_doors)
