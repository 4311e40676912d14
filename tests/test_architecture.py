"""The structure of the package (docs/architecture.md): one-way imports, a small top
level, no reach-ins into the Trainer, and every old module path still importable."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import ember
from ember.compat.paths import MOVED

LIB = Path(ember.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for p in LIB.rglob("*.py"):
        parts = list(p.relative_to(LIB.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(path: Path, modules: dict) -> set[str]:
    """The ember modules ``path`` imports (at any depth: imports inside functions count)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            # a bare ``import ember`` reads ``ember.__version__``: no arrow into the package's modules
            names = [a.name for a in node.names if a.name != "ember"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = ".".join(path.relative_to(LIB.parent).with_suffix("").parts[:-1])
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
                     if not (base == "ember" and a.name == "__version__")]
        else:
            continue
        found.update(n for n in names if n in modules)
    return found


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    # Tarjan's strongly connected components
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

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
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    import sys
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10000))
    try:
        for v in graph:
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    assert cycles == [], f"import cycles: {cycles}"


#: ember's packages (and top-level modules) from the top down (docs/architecture.md, "The
#: packages and their arrows"): a module may import from a lower layer only, never from its
#: own layer's other packages nor from above (an import inside a function counts too).
LAYERS = [
    ("__main__",),                                         # python -m ember
    ("cli", "tuner"),                                      # the command line, the tuner
    ("ember", "fabric", "utils", "utilities", "logging"),  # public paths: names only
    ("compat",),                                           # the Accelerate and Lightning renaming layers
    ("accelerator", "trainer", "integrations"),            # the two APIs (neither uses the other), integrations
    ("callbacks",),
    ("module", "loggers"),
    ("step", "launch"),
    ("strategies", "data", "big_modeling"),
    ("checkpoint",),
    ("distributed", "precision", "hparams"),
    ("errors",),
]


def _package(module: str) -> str:
    """``ember.trainer.loops`` -> ``trainer``; ``ember.utils`` -> ``utils``; ``ember`` -> ``ember``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "ember"


def upward_imports(modules: dict[str, Path]) -> list[str]:
    """Every import from a package into one of the same layer or a higher one."""
    layer = {pkg: i for i, names in enumerate(LAYERS) for pkg in names}
    bad = []
    for m, p in modules.items():
        for target in _imports(p, modules):
            a, b = _package(m), _package(target)
            if a != b and layer[b] <= layer[a]:
                bad.append(f"{m} -> {target} ({a} is not above {b})")
    return sorted(bad)


def test_every_package_has_a_layer():
    packages = {_package(m) for m in _modules()}
    listed = [pkg for names in LAYERS for pkg in names]
    assert len(listed) == len(set(listed))
    assert packages == set(listed), (sorted(packages - set(listed)), sorted(set(listed) - packages))


def test_imports_point_down_the_layers():
    assert upward_imports(_modules()) == []


def test_the_page_lists_the_layers():
    """docs/architecture.md shows ``LAYERS``, one layer a line, in the block after "From the top down"."""
    page = (LIB.parent / "docs" / "architecture.md").read_text()
    block = page.split("From the top down:", 1)[1].split("```", 2)[1]
    shown = [tuple(n.strip() for n in re.split(r"\s{2,}", line.strip())[0].split(","))
             for line in block.strip().splitlines()]
    assert shown == LAYERS


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """The check itself: a checkpoint module that imports the trainer, or compat, is caught."""
    fake = tmp_path / "ember" / "checkpoint" / "up.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def f():\n    from ember.compat import accelerate\n    import ember.trainer.loops\n")
    modules = dict(_modules(), **{"ember.checkpoint.up": fake})
    bad = upward_imports(modules)
    assert bad == ["ember.checkpoint.up -> ember.compat.accelerate (checkpoint is not above compat)",
                   "ember.checkpoint.up -> ember.trainer.loops (checkpoint is not above trainer)"]


def test_at_most_eight_modules_at_the_top():
    top = sorted(p.name for p in LIB.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= 8, top


def test_callbacks_loggers_strategies_never_import_the_trainer():
    modules = _modules()
    offenders = {m: sorted(i for i in _imports(p, modules) if i == "ember.trainer" or i.startswith("ember.trainer."))
                 for m, p in modules.items()
                 if m.startswith(("ember.callbacks", "ember.loggers", "ember.strategies", "ember.step"))}
    assert {m: v for m, v in offenders.items() if v} == {}


def test_no_private_trainer_fields_outside_the_trainer_package():
    pat = re.compile(r"\b(trainer|_trainer)\._[a-z]\w*")
    hits = [f"{p.relative_to(LIB)}: {m.group(0)}" for p in LIB.rglob("*.py")
            if not p.relative_to(LIB).as_posix().startswith("trainer/")
            for m in pat.finditer(p.read_text())]
    assert hits == []


def test_launch_imports_no_torch():
    """``ember launch`` starts fast: its package imports no torch (the ranks it starts do)."""
    import subprocess
    import sys
    code = "import sys, ember.launch.command; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_every_moved_path_imports_as_the_same_module():
    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
        assert importlib.import_module(new).__spec__.name == new   # its own spec is kept
    from ember.local_sgd import LocalSGD
    from ember.accelerator.local_sgd import LocalSGD as Same
    assert LocalSGD is Same
    import ember.checkpoint_io as old_io
    assert old_io.META_NAME == "meta.json"
