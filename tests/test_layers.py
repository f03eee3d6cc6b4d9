"""The layers of docs/architecture.md ("Layers") hold in the source, not just at import time: a function-level, lazy
or TYPE_CHECKING import would pass an import-time check, so these read every module's syntax tree.

LAYERS below is the doc's layer table, row for row (`test_the_layer_table_is_the_docs` reads the doc's markdown and
fails when the two differ: change both together). Each row names modules of dovetail (a package, or a top-level
module) and what they may import: the dovetail layers named, "everything above" (every row before it), "everything",
and of the outside world only torch and Ray are held (a row may import them only where it names them, or they come
with "everything above"). A module may import the modules of its own row. Besides, the module-level import graph of
dovetail (every import in a module's syntax tree an edge) has no cycle.

KNOWN_VIOLATIONS are the imports that break this today, subtracted from both checks; an entry that no longer
occurs fails the test too, so the list can only shrink. A lazy registry's "module:attribute" strings (`sched.POLICIES`,
`kinds.KINDS`) are not imports: each layer resolves only the parts at or below it."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dovetail"
DOC = ROOT / "docs" / "architecture.md"

ABOVE = "everything above"
EVERYTHING = "everything"
EXTERNAL = ("torch", "ray")
"""The outside packages the table holds: the planner runs without either."""

INIT = "__init__"
"""The table's name for dovetail's own `__init__.py` (the package's `import dovetail`)."""

LAYERS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    # (the modules of the row, what they may import), in the doc's order: a row may import only the rows it names
    (("algo",), ("torch",)),
    (("models",), ("algo", "prompts", "files", "rewards", "tasks", "graph", "torch")),
    (("prompts",), ()),
    (("rewards", "tasks"), ("torch",)),
    (("envs",), ("rewards", "tasks", "files", "graph")),
    (("files",), ()),
    (("kinds",), ()),
    (("trackers",), ("torch",)),
    (("cost",), ()),
    (("graph",), ("cost",)),
    (("sched",), ("graph", "cost", "kinds")),
    (("plan",), ("files", "cost", "graph", "sched")),
    (("config",), ("files", "kinds", "rewards", "tasks", "cost", "graph", "sched", "plan", "torch")),
    (("run_dir",), ("files", "kinds", "config", "torch")),
    (("request",), ("files", "kinds", "config", "run_dir", "trackers")),
    (("runtime",), (ABOVE, "ray")),
    (("pipelines",), (ABOVE,)),
    (("cli", "runner", "api", "export", INIT), (EVERYTHING,)),
)

KNOWN_VIOLATIONS: set[tuple[str, str]] = set()
"""(importer, imported): imports that run up the table or close a cycle, while they are being removed (none now);
an entry goes with its import, or with a change of the table in the doc and here alike."""


# ------------------------------------------------------------------------------------------ reading the source


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name, for its `__init__.py`)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == INIT else parts)] = path
    return modules


def imports_of(path: Path, module: str, modules: dict[str, Path]) -> dict[str, int]:
    """Everything a module imports, at any depth of its syntax tree (in a function, under TYPE_CHECKING), with the
    first line importing it: a module of the package as its dotted name (`from a.b import c` is `a.b.c` where that is
    a module, else `a.b`), anything else as its top-level package's name."""
    package = module if path.name == f"{INIT}.py" else module.rpartition(".")[0]
    root = module.partition(".")[0]
    found: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        if name.partition(".")[0] == root:
            while name not in modules and "." in name:
                name = name.rpartition(".")[0]
        else:
            name = name.partition(".")[0]
        if name != module:
            found[name] = min(line, found.get(name, line))

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:  # relative: from the module's package, one package up per further dot
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = ".".join(filter(None, [base, node.module]))
            for alias in node.names:
                target = f"{source}.{alias.name}"
                add(target if target in modules else source, node.lineno)
    return found


def import_graph(package: Path = PACKAGE) -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    modules = module_files(package)
    return {name: imports_of(path, name, modules) for name, path in modules.items()}, modules


# ------------------------------------------------------------------------------------------ the table


def parse_layer_table(markdown: str) -> tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]:
    """The first table after the "## Layers" heading: per row the backquoted names of its first column and the
    comma-separated entries of its last ("—" for none)."""
    section = markdown.split("\n## Layers", 1)[1]
    rows = []
    for line in section.splitlines():
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if set(cells[0]) <= set("-: ") or cells[0] == "package":
            continue
        imports = () if cells[-1] in ("—", "") else tuple(entry.strip() for entry in cells[-1].split(","))
        rows.append((tuple(re.findall(r"`([^`]+)`", cells[0])), imports))
    return tuple(rows)


def layer_of(module: str) -> str:
    """The table's name for a module: its first part below dovetail, or "__init__" for dovetail itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else INIT


def allowed_imports(layers=LAYERS) -> dict[str, set[str]]:
    """Table name -> the names (and outside packages) its modules may import."""
    everything = {name for names, _ in layers for name in names} | set(EXTERNAL)
    allowed: dict[str, set[str]] = {}
    names_above: set[str] = set()
    external_above: set[str] = set()
    for names, imports in layers:
        permitted = set(names)
        for entry in imports:
            if entry == EVERYTHING:
                permitted |= everything
            elif entry == ABOVE:
                permitted |= names_above | external_above
            else:
                permitted.add(entry)
        allowed.update(dict.fromkeys(names, permitted))
        names_above |= set(names)
        external_above |= permitted & set(EXTERNAL)
    return allowed


def layer_violations(graph: dict[str, dict[str, int]], layers=LAYERS) -> set[tuple[str, str]]:
    """(importer, imported) for every import of a dovetail module or of torch / Ray its row does not permit."""
    allowed = allowed_imports(layers)
    return {
        (module, imported)
        for module, imports in graph.items()
        for imported in imports
        if (imported in EXTERNAL or imported in graph)
        and (imported if imported in EXTERNAL else layer_of(imported)) not in allowed[layer_of(module)]
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path back to its start) through each strongly connected part of `graph` that has one, by
    Tarjan's algorithm (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    parts = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        part.add(member)
                        if member == node:
                            break
                    if len(part) > 1 or node in graph.get(node, ()):
                        parts.append(part)
    return [cycle_through(graph, part) for part in parts]


def cycle_through(graph: dict[str, set[str]], part: set[str]) -> list[str]:
    """A shortest cycle from the part's first member back to it, inside the part."""
    start = min(part)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph.get(node, ())):
                if successor == start:
                    return paths[node] + [start]
                if successor in part and successor not in paths:
                    paths[successor] = paths[node] + [successor]
                    following.append(successor)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def dovetail_edges(graph: dict[str, dict[str, int]], leaving_out=frozenset()) -> dict[str, set[str]]:
    return {
        module: {imported for imported in imports if imported in graph and (module, imported) not in leaving_out}
        for module, imports in graph.items()
    }


def no_longer_occurring(graph: dict[str, dict[str, int]], known, layers=LAYERS) -> list[tuple[str, str]]:
    """The entries of `known` whose import is gone, or breaks neither the table nor the no-cycle rule any more."""
    edges = dovetail_edges(graph)

    def closes_a_cycle(a: str, b: str) -> bool:
        """Whether `b` leads back to `a`: the import a -> b is then on a cycle."""
        seen, frontier = {b}, [b]
        while frontier:
            node = frontier.pop()
            if node == a:
                return True
            for successor in edges.get(node, set()) - seen:
                seen.add(successor)
                frontier.append(successor)
        return False

    violations = layer_violations(graph, layers)
    return sorted(
        (a, b) for a, b in known if b not in graph.get(a, {}) or not ((a, b) in violations or closes_a_cycle(a, b))
    )


def where(graph, modules, edges) -> list[str]:
    return [f"{modules[a].relative_to(ROOT)}:{graph[a][b]}: {a} imports {b}" for a, b in edges]


# ------------------------------------------------------------------------------------------ the tests


def test_the_layer_table_is_the_docs():
    assert parse_layer_table(DOC.read_text()) == LAYERS, "docs/architecture.md's layer table and LAYERS differ"


def test_every_module_is_in_one_row_and_every_row_names_modules():
    names = [name for names, _ in LAYERS for name in names]
    assert len(names) == len(set(names)), "a name in two rows"
    modules = module_files()
    assert sorted({layer_of(module) for module in modules} - set(names)) == [], "modules in no row of LAYERS"
    assert sorted(set(names) - {layer_of(module) for module in modules}) == [], "rows naming no module"
    permitted = set(names) | set(EXTERNAL) | {ABOVE, EVERYTHING}
    assert sorted({entry for _, imports in LAYERS for entry in imports} - permitted) == []


def test_every_import_runs_down_the_layer_table():
    graph, modules = import_graph()
    new = layer_violations(graph) - KNOWN_VIOLATIONS
    assert not new, "imports the layer table does not permit:\n" + "\n".join(where(graph, modules, sorted(new)))


def test_the_import_graph_has_no_cycle():
    graph, modules = import_graph()
    found = cycles(dovetail_edges(graph, leaving_out=KNOWN_VIOLATIONS))
    report = [line for cycle in found for line in [" -> ".join(cycle), *where(graph, modules, zip(cycle, cycle[1:]))]]
    assert found == [], "import cycles, each with its imports:\n" + "\n".join(report)


def test_known_violations_still_occur_so_the_list_only_shrinks():
    gone = no_longer_occurring(import_graph()[0], KNOWN_VIOLATIONS)
    assert gone == [], "KNOWN_VIOLATIONS entries that no longer occur (remove them):\n" + "\n".join(map(str, gone))


def test_the_planner_never_imports_torch_or_ray():
    """cost, graph, sched and the planner (`plan`: the scenario, prepare, the simulator, the report), and every dovetail
    module they import, at any depth: planning a 64-GPU run takes seconds on a laptop, without starting either."""
    graph, modules = import_graph()
    roots = [m for m in graph if layer_of(m) in ("cost", "graph", "sched", "plan")]
    planner, frontier = set(roots), list(roots)
    while frontier:
        for imported in graph[frontier.pop()]:
            if imported in graph and imported not in planner:
                planner.add(imported)
                frontier.append(imported)
    assert "dovetail.plan.loop" in planner and "dovetail.plan.report" in planner and "dovetail.graph.node" in planner
    heavy = {(m, imported) for m in planner for imported in graph[m] if imported in EXTERNAL}
    assert not heavy, "\n".join(where(graph, modules, sorted(heavy)))


# ------------------------------------------------------------------------------------------ the checks themselves


def test_the_check_sees_function_level_type_checking_and_from_package_imports(tmp_path):
    package = tmp_path / "dovetail"
    (package / "sched").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sched" / "__init__.py").write_text("")
    (package / "sched" / "policy.py").write_text("import ray\n")
    (package / "api.py").write_text("")
    (package / "lazy.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import torch.nn\n"
        "def f():\n    from dovetail.sched.policy import Policy\n    from dovetail import api\n    return Policy\n"
    )
    graph, _ = import_graph(package)
    assert graph["dovetail.lazy"] == {"typing": 1, "torch": 3, "dovetail.sched.policy": 5, "dovetail.api": 6}
    layers = ((("sched",), ()), (("lazy", "api", INIT), ("sched",)))
    assert layer_violations(graph, layers) == {("dovetail.lazy", "torch"), ("dovetail.sched.policy", "ray")}


def test_the_cycle_check_finds_each_cycle():
    graph = {"a": {"b"}, "b": {"c", "a"}, "c": {"a"}, "d": {"d"}, "e": {"a"}}
    assert cycles(graph) == [["a", "b", "a"], ["d", "d"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_an_entry_of_the_known_violations_counts_while_its_import_breaks_the_table_or_closes_a_cycle():
    graph = {
        "dovetail.low": {"dovetail.high": 1},  # runs up
        "dovetail.high": {"dovetail.high2": 1},
        "dovetail.high2": {"dovetail.high": 1},  # closes a cycle with high
        "dovetail.top": {"dovetail.low": 1},
    }
    layers = ((("low",), ()), (("high", "high2"), (ABOVE,)), (("top",), (ABOVE,)))
    known = {("dovetail.low", "dovetail.high"), ("dovetail.high2", "dovetail.high")}
    assert no_longer_occurring(graph, known, layers) == []
    gone = {("dovetail.top", "dovetail.low"), ("dovetail.low", "dovetail.high2")}  # permitted, no cycle; not imported
    assert no_longer_occurring(graph, known | gone, layers) == sorted(gone)


def test_everything_above_brings_the_rows_above_and_their_outside_packages():
    allowed = allowed_imports(((("low",), ("torch",)), (("mid",), ()), (("high",), (ABOVE,)), (("top",), ())))
    assert allowed["high"] == {"low", "mid", "high", "torch"}
    assert allowed["mid"] == {"mid"} and allowed["top"] == {"top"}
