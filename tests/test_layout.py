"""The house rules, checked on the source: the layers import only downwards, and everything
that observes an engine (widgets, server, CLI, benchmarks, notebooks) goes through its
public read API (`info()`, `stats()`, `kv_blocks()`, `request_states()`, `telemetry`) and
the documented `add_request`/`step`, never inside it."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "workbench"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module path imported anywhere in the file (lazy imports inside functions too)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)   # `from . import x`
    return found


def floor(mod: str) -> str:
    """workbench.engine.core -> workbench.engine; a name imported from workbench/__init__
    (workbench.Engine) -> workbench."""
    parts = mod.split(".")
    if len(parts) < 2 or not ((PKG / parts[1]).is_dir() or (PKG / f"{parts[1]}.py").exists()):
        return parts[0]
    return ".".join(parts[:2])


# What each floor of the package may import from the workbench (besides itself). A floor
# is a top-level module or package of workbench/; "workbench" is the package's __init__.
ALLOWED = {
    "workbench.utils": set(),
    "workbench.config": set(),
    "workbench.cache": set(),
    "workbench.launch": set(),
    "workbench.telemetry": set(),
    "workbench.roofline": {"workbench.cache", "workbench.telemetry"},
    "workbench.platforms": {"workbench.config", "workbench.cache", "workbench.utils"},
    # The pure-Python core: scheduler, block pool, sequences, sampling params. No device.
    "workbench.core": {"workbench.config", "workbench.telemetry", "workbench.utils"},
    "workbench.executor": {"workbench.config", "workbench.cache", "workbench.telemetry", "workbench.utils",
                           "workbench.platforms", "workbench.core"},
    # The modelled device: the cost model over roofline's counts, a runner in the executor's
    # stead (the graph plan with its kind's platform rules), fitted to a real engine's telemetry.
    "workbench.modelled": {"workbench.config", "workbench.cache", "workbench.telemetry",
                           "workbench.utils", "workbench.core", "workbench.executor",
                           "workbench.platforms", "workbench.roofline"},
    # Speculative decoding's proposers: n-gram lookup (numpy), a draft model (the executor's
    # models and loaders).
    "workbench.spec_decode": {"workbench.config", "workbench.cache", "workbench.telemetry",
                              "workbench.utils", "workbench.core", "workbench.executor",
                              "workbench.platforms"},
    "workbench.engine": {"workbench.config", "workbench.telemetry", "workbench.utils", "workbench.core",
                         "workbench.executor", "workbench.platforms", "workbench.roofline",
                         "workbench.modelled", "workbench.cache", "workbench.spec_decode"},
    "workbench": {"workbench.config", "workbench.engine", "workbench.core", "workbench.utils"},
    "workbench.trace": {"workbench.engine", "workbench.core", "workbench.telemetry",
                        "workbench.config", "workbench.roofline", "workbench"},
    "workbench.serving": {"workbench.engine", "workbench.core", "workbench.telemetry",
                          "workbench.config", "workbench"},
    # platforms: the device scripts' timer (bench/device_run.py, Platform.best_time).
    "workbench.bench": {"workbench.engine", "workbench.core", "workbench.telemetry",
                        "workbench.serving", "workbench.config", "workbench.platforms"},
    # The goodput tuner: drives engines on workloads, reads knob domains from the platforms.
    "workbench.tune": {"workbench.utils", "workbench.engine", "workbench.core",
                       "workbench.telemetry",
                       "workbench.config", "workbench.platforms", "workbench.trace",
                       "workbench.modelled"},
    "workbench.cli": {"workbench", "workbench.config", "workbench.bench", "workbench.serving",
                      "workbench.trace", "workbench.platforms", "workbench.launch",
                      "workbench.tune"},
}


def workbench_files():
    return sorted(p for p in PKG.rglob("*.py") if "csrc" not in p.parts)


def test_layers_import_only_downwards():
    wrong = []
    for path in workbench_files():
        mod = module_name(path)
        own = floor(mod)
        for imp in imports_of(path):
            top = imp.split(".")[0]
            if top in ("widgets", "ipywidgets", "plotly"):
                wrong.append(f"{mod} imports {imp}: the engine never imports the UI")
            if top != "workbench":
                continue
            target = floor(imp)
            if target == own:
                continue
            if target not in ALLOWED.get(own, set()):
                wrong.append(f"{mod} imports {imp}")
    assert not wrong, "\n".join(wrong)


def floor_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle in `graph` (floor -> floors it may import), as a path, or None."""
    state: dict[str, int] = {}        # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_floors_form_no_cycle():
    """The floors stack: no floor may import, even through others, one that imports it
    (core <-> executor was such a cycle). Every floor of the package has a row."""
    floors = {floor(module_name(p)) for p in workbench_files()}
    assert floors <= set(ALLOWED), f"floors with no row in ALLOWED: {floors - set(ALLOWED)}"
    assert floor_cycle(ALLOWED) is None, " -> ".join(floor_cycle(ALLOWED))


CONSUMERS = ([*sorted((ROOT / "widgets").glob("*.py")), *sorted((PKG / "serving").glob("*.py")),
              *sorted((PKG / "bench").glob("*.py")), PKG / "cli.py",
              *sorted((ROOT / "benchmarks").glob("*.py"))])
INTERNALS = re.compile(r"\.(block_manager|scheduler|runner|model_runner)\b|"
                       r"\b(engine|eng|e|self\.engine)\.(model|platform|hf_config)\b")
PRIVATE = re.compile(r"\b(?!self\b|cls\b)[A-Za-z_]\w*\._[a-z]\w*")
# Reads of another library's underscore names that its own docs tell you to use.
FOREIGN_PRIVATE = {"config._attn_implementation",
                   "utils._python_dispatch"}    # TorchDispatchMode's documented home
CORE_DIAGNOSTICS = {"gpu.py", "npu.py"}
"""Device benchmarks that time kernels and graph replays may reach the engine core
(`engine.core`), on purpose and nowhere else."""


def consumer_sources():
    for path in CONSUMERS:
        yield path.relative_to(ROOT), path.read_text()
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        yield nb.relative_to(ROOT), "\n".join("".join(c["source"]) for c in cells
                                              if c["cell_type"] == "code")


@pytest.mark.parametrize("name,source", list(consumer_sources()), ids=lambda v: str(v)[:40])
def test_consumers_use_the_public_read_api(name, source):
    bad = []
    for i, line in enumerate(source.splitlines(), 1):
        code = line.split("#")[0]
        for m in PRIVATE.finditer(code):
            if m.group(0) not in FOREIGN_PRIVATE:
                bad.append(f"{name}:{i}: private access {m.group(0)!r}")
        if code.lstrip().startswith(("from ", "import ")):
            continue                      # importing workbench.core's types is fine
        diagnostic = Path(name).name in CORE_DIAGNOSTICS and ".core." in code
        if INTERNALS.search(code) and not diagnostic:
            bad.append(f"{name}:{i}: reads an engine internal: {line.strip()}")
        if ".core." in code and not diagnostic:
            bad.append(f"{name}:{i}: reaches into the engine core: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_the_checks_catch_what_they_forbid():
    """The patterns above find the reads they exist to forbid (so the test can fail)."""
    assert INTERNALS.search("bm = self.engine.block_manager")
    assert INTERNALS.search("dtype = next(e.model.parameters()).dtype")
    assert PRIVATE.search("e._drain_inbox()") and not PRIVATE.search("self._lock")
    assert "workbench.engine" not in ALLOWED["workbench.platforms"]
    assert floor_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert floor_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


# ---- one rule in one place: the device scripts' harness, the percentile --------------------------
DEVICE_SCRIPTS = [ROOT / "benchmarks" / "gpu.py", ROOT / "benchmarks" / "npu.py"]


def defined_names(tree: ast.AST) -> set[str]:
    """The functions a module defines anywhere (methods and nested ones too), and the names
    it binds to a lambda."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def hand_rolled_order_statistics(tree: ast.AST) -> list[int]:
    """Lines that pick an order statistic by index arithmetic on a length (xs[len(xs) // 2],
    xs[int(q * len(xs))]) rather than through telemetry.percentile."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Subscript):
            continue
        inner = list(ast.walk(node.slice))
        uses_len = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                       and n.func.id == "len" for n in inner)
        scales = any(isinstance(n, ast.BinOp) and isinstance(n.op, (ast.FloorDiv, ast.Mult))
                     for n in inner)
        if uses_len and scales:
            lines.append(node.lineno)
    return lines


def test_device_scripts_share_one_harness():
    """benchmarks/gpu.py and npu.py use bench/device_run.py and define none of what it
    defines (JSON lines, guarded parts, the timer, W1 and its prompts, the bf16 rule), nor
    a percentile or timer of their own."""
    shared = defined_names(ast.parse((PKG / "bench" / "device_run.py").read_text()))
    shared |= {"percentile", "distribution", "pct", "median", "best_time", "rel"}
    shared -= {"__init__"}
    for path in DEVICE_SCRIPTS:
        assert "workbench.bench.device_run" in imports_of(path), path.name
        again = sorted(defined_names(ast.parse(path.read_text())) & shared)
        assert not again, f"{path.name} defines its own {again}: use bench/device_run.py"


def test_one_percentile():
    """Percentiles and medians of data go through telemetry.percentile (interpolated, as
    numpy and vLLM's benchmarks), never an index picked by hand."""
    files = [*workbench_files(), *sorted((ROOT / "benchmarks").glob("*.py")),
             *sorted((ROOT / "widgets").glob("*.py"))]
    bad = [f"{p.relative_to(ROOT)}:{line}" for p in files
           for line in hand_rolled_order_statistics(ast.parse(p.read_text()))]
    assert not bad, "hand-rolled percentiles (use telemetry.percentile): " + ", ".join(bad)


def test_the_harness_checks_catch_what_they_forbid():
    old = ast.parse("def emit(part): pass\n"
                    "pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))]\n"
                    "m = sorted(t)[len(t) // 2]\nlast = xs[len(xs) - 1]\n")
    assert {"emit", "pct"} <= defined_names(old)
    assert sorted(hand_rolled_order_statistics(old)) == [2, 3]


LONG_MODULES: dict[str, str] = {}
"""Modules of workbench/ allowed past MAX_LINES, each with the reason (none today)."""
MAX_LINES = 450


def test_each_module_is_one_idea_of_readable_size():
    """No module of the package grows past MAX_LINES unless LONG_MODULES says why: a module that
    long is usually several ideas (the second pass split engine_core.py, protocol.py, app.py,
    client.py, cli.py and tools.py along theirs)."""
    long = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in workbench_files()}
    over = {p: n for p, n in long.items() if n > MAX_LINES and p not in LONG_MODULES}
    assert not over, f"modules over {MAX_LINES} lines with no reason in LONG_MODULES: {over}"


def module_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, lazy imports included; imports under
    `if TYPE_CHECKING:` (annotations only) and of a package's __init__ (which re-exports its
    modules: `from . import x` names the package too) do not count."""
    mods = {module_name(p): p for p in workbench_files()}
    packages = {module_name(p) for p in workbench_files() if p.name == "__init__.py"}
    graph = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test)
                       for stmt in node.body for n in ast.walk(stmt)}
        kept = ast.Module(body=[n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                                and id(n) not in typing_only], type_ignores=[])
        found = set()
        for node in kept.body:
            found |= _imports_of_node(node, mod, path)
        graph[mod] = {m for m in found if m in mods and m != mod and m not in packages}
    return graph


def _imports_of_node(node, mod: str, path: Path) -> set[str]:
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if node.level:
        base = package.split(".")[:len(package.split(".")) - node.level + 1]
        m = ".".join(base + ([node.module] if node.module else []))
    else:
        m = node.module or ""
    return {m} | {f"{m}.{a.name}" for a in node.names}


KNOWN_CYCLES: dict = {}


def test_modules_import_each_other_in_one_direction():
    """No two modules of the package import each other, even lazily or through others (the
    CPU platform and its ops did), except the cycles KNOWN_CYCLES names with their reason."""
    graph = module_graph()
    seen = set()
    while (cycle := floor_cycle(graph)) is not None:
        members = frozenset(cycle)
        known = next((k for k in KNOWN_CYCLES if members <= k), None)
        assert known is not None, "import cycle: " + " -> ".join(cycle)
        seen.add(known)
        graph[cycle[-2]] = graph[cycle[-2]] - {cycle[-1]}      # cut it, look for others
    assert seen == set(KNOWN_CYCLES), f"cycles no longer there: {set(KNOWN_CYCLES) - seen}"
