"""The package's shape: imports only downward through its layers, no import cycles between its
modules, no function over 60 lines without a reason in its docstring. Every import counts,
function-level ones too: a lazy import hides a cycle from Python but not from a reader."""
from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "tiersep").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the tiersep modules it imports (`from pkg import sub` counts as sub, not pkg)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
                deps.update(subs)
                if len(subs) < len(node.names) and base in modules:
                    deps.add(base)
        deps.discard(name)
        graph[name] = deps
    return graph


# The layers, lowest first (docs/architecture.md draws them). A module may import, in a function
# too, or name in a string ("tiersep.train..." in a subprocess command or a probe's code), only
# modules of its own layer or of a layer below it. Names are the first part after "tiersep."
# ("" is the package itself: its __version__). A new top-level module or package fails
# test_every_module_has_a_layer until it is given a place here and in docs/architecture.md.
LAYERS = [
    ["", "io", "resources"],                                           # files, the package's own data
    ["config"],                                                        # config, presets, schemas, one-line errors
    ["model", "records", "outputs", "device", "gpu_info", "gpu_catalogue", "gpu_lease", "lock", "probe", "malloc"],
    ["data"],                                                          # datasets: prepare, ingest, load
    ["memory"],                                                        # estimates, the fit gate
    ["separate"],                                                      # overlap-add, `tiersep separate`
    ["evaluate"],                                                      # scores on the test split
    ["train"],                                                         # the trainer, DDP
    ["search"],                                                        # the hyperparameter search
    ["report"],                                                        # the HTML report
    ["cli", "__main__"],                                               # the `tiersep` command
]
LAYER_OF = {name: rank for rank, names in enumerate(LAYERS) for name in names}
MODULE_IN_TEXT = re.compile(r"\btiersep((?:\.[A-Za-z_]\w*)+)")


def layer(module: str) -> int | None:
    """The rank of a tiersep module's layer (None: a top-level name LAYERS does not place)."""
    parts = module.split(".")
    return LAYER_OF.get(parts[1] if len(parts) > 1 else "")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes: they describe, they do not depend (a docstring may say which
    command calls a function)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def named_in_strings(source: str, modules: set[str]) -> set[str]:
    """The tiersep modules a source names in its string constants (docstrings aside), each cut to
    the longest known module: "-m tiersep.cli" names tiersep.cli, "tiersep.memory.x.f" tiersep.memory.x."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            for match in MODULE_IN_TEXT.finditer(node.value):
                parts = ("tiersep" + match.group(1)).split(".")
                while len(parts) > 1 and ".".join(parts) not in modules:
                    parts.pop()
                if len(parts) > 1:
                    named.add(".".join(parts))
    return named


def upward_edges(graph: dict[str, set[str]], strings: dict[str, set[str]]) -> list[str]:
    """Every import or string naming a module of a higher layer, as 'a -> b (how)'."""
    found = []
    for module in sorted(graph):
        for target, how in [(t, "import") for t in sorted(graph[module])] + \
                           [(t, "string") for t in sorted(strings.get(module, ()))]:
            if layer(target) is not None and layer(module) is not None and layer(target) > layer(module):
                found.append(f"{module} -> {target} ({how})")
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert "tiersep.memory.estimate" in graph and "tiersep.memory.analytic" in graph["tiersep.memory.estimate"]
    assert cycles(graph) == []


def test_the_layer_check_sees_imports_in_functions_and_names_in_strings():
    modules = {"tiersep.memory", "tiersep.memory.fit", "tiersep.train", "tiersep.train.trainer", "tiersep.cli"}
    code = '''"""Called by tiersep.train.trainer (a docstring: not a dependency)."""
def probe():
    from tiersep.train import trainer
    return "import tiersep.cli, tiersep.train.trainer.train" + f"{1}-m tiersep.memory.fit"
'''
    assert named_in_strings(code, modules) == {"tiersep.cli", "tiersep.train.trainer", "tiersep.memory.fit"}
    graph = {"tiersep.memory.fit": {"tiersep.train.trainer"}, "tiersep.train.trainer": {"tiersep.memory.fit"}}
    strings = {"tiersep.memory.fit": {"tiersep.cli"}, "tiersep.cli": {"tiersep.memory.fit"}}
    assert upward_edges(graph, strings) == ["tiersep.memory.fit -> tiersep.train.trainer (import)",
                                            "tiersep.memory.fit -> tiersep.cli (string)"]


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in _modules() if layer(m) is None)
    assert not unplaced, "give these a layer in LAYERS and docs/architecture.md: " + ", ".join(unplaced)


def test_imports_only_run_down_the_layers():
    modules = _modules()
    strings = {name: named_in_strings(path.read_text(), set(modules)) for name, path in modules.items()}
    assert any(strings.values()), "the string check found no module named in any string: is it looking?"
    upward = upward_edges(import_graph(), strings)
    assert not upward, "imports or module names from a higher layer (tests/test_architecture.py LAYERS):\n" + \
        "\n".join(upward)


def test_no_long_function_without_a_reason():
    long = []
    for path in (SRC / "tiersep").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                doc = ast.get_docstring(node) or ""
                if lines > MAX_FUNCTION_LINES and "long because" not in doc.lower():
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions over 60 lines need 'Long because ...' in their docstring:\n" + "\n".join(long)
