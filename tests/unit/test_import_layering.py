"""The layering of hvdlite's imports: no circles, and no import pointing up the layers.

Every module under hvdlite/ is parsed with ``ast`` (no import runs): each ``import`` and
``from ... import`` counts, those inside functions included (an import hidden in a
function is still a dependency), except under ``if TYPE_CHECKING:``. Relative imports
are resolved; ``from pkg import name`` counts as an import of ``pkg.name`` when that is
a module, else of ``pkg``. The parent packages that Python imports implicitly are not
edges: a package's ``__init__`` is a module of its own, placed in the table like the rest.

``LAYERS`` is the order, lowest first (the contributors' folder map describes it): a
module may import modules of its own layer or below, never above; inside one layer the
imports must not form a cycle. Every module under hvdlite/ must be in the table, so a new
one is placed on purpose. A name ending in ``.*`` places a package and all its modules.
A name in the table may come before its module (``hvdlite.build_record``).
"""
import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "hvdlite"

# Lowest first. Modules of one layer may import each other (without cycles).
LAYERS = [
    ("standard library only", [
        "hvdlite.errors", "hvdlite.env_aliases", "hvdlite.peer_faults",
        "hvdlite.elastic.protocol", "hvdlite.elastic.store", "hvdlite.timeline_summary",
        "hvdlite.build_record",  # the build record's reader (loader and runner)
    ]),
    ("the compiled library", ["hvdlite._native"]),
    ("dtypes and handles", ["hvdlite.dtypes", "hvdlite.handle"]),
    ("the running core and its process sets", ["hvdlite.core", "hvdlite.process_sets"]),
    ("enqueue, names, refusals, validation", [
        "hvdlite._enqueue", "hvdlite._names", "hvdlite._refusals", "hvdlite._checks"]),
    ("the framework-free API on numpy arrays", [
        "hvdlite.adasum", "hvdlite.ops", "hvdlite.objects", "hvdlite.reducers",
        "hvdlite.compression"]),
    ("init, and the build's capabilities", ["hvdlite.runtime", "hvdlite.capabilities"]),
    # The framework-free elastic state; the adapters' elastic modules build on it.
    ("elastic", ["hvdlite.elastic", "hvdlite.elastic.state", "hvdlite.elastic.variables"]),
    ("torch and tensorflow adapters", [
        "hvdlite.torch.*",
        "hvdlite.tensorflow.compression", "hvdlite.tensorflow.elastic",
        "hvdlite.tensorflow.errors", "hvdlite.tensorflow.functions",
        "hvdlite.tensorflow.gradient_tape", "hvdlite.tensorflow.gradients",
        "hvdlite.tensorflow.mpi_ops", "hvdlite.tensorflow.execution",
        "hvdlite.tensorflow.sync_batch_norm", "hvdlite.tensorflow.tensors",
        "hvdlite.tensorflow.util"]),
    # Keras 3, on whichever backend runs (it reaches the torch and tensorflow adapters).
    ("keras", ["hvdlite.keras.*"]),
    # What also reaches Keras: the TF DistributedOptimizer wraps Keras optimizers too.
    ("tensorflow's top", [
        "hvdlite.tensorflow", "hvdlite.tensorflow.optimizer", "hvdlite.tensorflow.keras.*"]),
    # Integrations with other frameworks' trainers, on the adapters' public API.
    ("lightning", ["hvdlite.lightning.*"]),
    ("the package", ["hvdlite"]),
    ("launcher and command line", ["hvdlite.runner.*", "hvdlite.cli", "hvdlite.__main__"]),
    # Spark runs its ranks through the launcher (hvdliterun on the driver).
    ("spark", ["hvdlite.spark.*"]),
    # Ray: the world across Ray actors is formed by the launcher's own machinery.
    ("ray", ["hvdlite.ray.*"]),
]


def module_files(package_dir=PACKAGE_DIR):
    """{module name: (path, is package)} of every .py file under ``package_dir``."""
    root = package_dir.parent
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


def _is_type_checking(test):
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _import_nodes(tree):
    """The Import/ImportFrom nodes of a tree, anywhere, except under TYPE_CHECKING."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(name, path, is_package, modules):
    """{imported hvdlite module: first line} for module ``name``."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if is_package else name.rpartition(".")[0]

    def known(target):
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    found = {}
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules
                       else source for alias in node.names]
        for target in targets:
            if target == "hvdlite" or target.startswith("hvdlite."):
                target = known(target)
                if target is not None and target != name:
                    found.setdefault(target, node.lineno)
    return found


def import_graph(package_dir=PACKAGE_DIR):
    modules = module_files(package_dir)
    return {name: imports_of(name, path, is_package, modules)
            for name, (path, is_package) in modules.items()}


def layer_of(module, layers=LAYERS):
    """The index of ``module``'s layer, or None when the table does not place it."""
    for index, (_, names) in enumerate(layers):
        for entry in names:
            if entry == module or (entry.endswith(".*") and (
                    module == entry[:-2] or module.startswith(entry[:-1]))):
                return index
    return None


def find_cycles(graph):
    """The cycles of ``graph`` ({node: iterable of nodes}), one per strongly connected
    component of more than one node: each as (a shortest cycle through its first node,
    the first repeated at the end; every node of the component)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = [0]

    def connect(node):  # Tarjan, iterative: modules can be many
        work = [(node, iter(sorted(graph.get(node, ()))))]
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        while work:
            current, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[current] = min(low[current], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[current])
            if low[current] == index[current]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == current:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [(_a_cycle(graph, component), component) for component in components]


def _a_cycle(graph, component):
    """One cycle through the first node of a strongly connected component."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to start
        following = []
        for node in frontier:
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    return paths[node] + [start]
                if nxt in members and nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    following.append(nxt)
        frontier = following
    return component + [start]


def upward_imports(graph, layers=LAYERS):
    """'a (layer) -> b (layer), line n' for each import of a module in a higher layer."""
    found = []
    for module, targets in sorted(graph.items()):
        own = layer_of(module, layers)
        for target, line in sorted(targets.items()):
            theirs = layer_of(target, layers)
            if own is not None and theirs is not None and theirs > own:
                found.append(f"{module} ({layers[own][0]}) imports {target} "
                             f"({layers[theirs][0]}), line {line}")
    return found


def test_every_module_is_placed_in_the_layer_table():
    unplaced = [m for m in sorted(module_files()) if layer_of(m) is None]
    assert not unplaced, (
        f"modules missing from LAYERS in {__file__}: {unplaced}; place each in its layer")


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles among hvdlite modules:\n" + "\n".join(
        f"{' -> '.join(cycle)} (all of {', '.join(members)} import each other, "
        "directly or not)" for cycle, members in cycles)


def test_no_import_points_up_the_layers():
    upward = upward_imports(import_graph())
    assert not upward, "imports that point up the layering:\n" + "\n".join(upward)


# The checks themselves, on a small made-up package.


def _write(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_find_a_cycle_hidden_in_a_function_and_an_upward_import(tmp_path):
    _write(tmp_path, {
        "hvdlite/__init__.py": "",
        "hvdlite/low.py": "def f():\n    from hvdlite import high\n",
        "hvdlite/high.py": "from . import low\n",
        "hvdlite/typed.py": ("from typing import TYPE_CHECKING\n"
                             "if TYPE_CHECKING:\n    from hvdlite import high\n"),
    })
    graph = import_graph(tmp_path / "hvdlite")
    assert graph["hvdlite.low"] == {"hvdlite.high": 2}
    assert graph["hvdlite.high"] == {"hvdlite.low": 1}
    assert graph["hvdlite.typed"] == {}
    assert find_cycles(graph) == [(["hvdlite.high", "hvdlite.low", "hvdlite.high"],
                                   ["hvdlite.high", "hvdlite.low"])]
    layers = [("low", ["hvdlite.low", "hvdlite.typed"]), ("high", ["hvdlite.high", "hvdlite"])]
    assert upward_imports(graph, layers) == [
        "hvdlite.low (low) imports hvdlite.high (high), line 2"]
    assert layer_of("hvdlite.other", layers) is None


def test_layer_wildcards_place_a_package_and_its_modules():
    layers = [("a", ["hvdlite.torch.*"])]
    assert layer_of("hvdlite.torch", layers) == 0
    assert layer_of("hvdlite.torch.mpi_ops", layers) == 0
    assert layer_of("hvdlite.torchvision", layers) is None
