"""The user's random streams are the user's (issue "Every kind of data resumes exactly",
item 7): ``fit`` leaves python ``random``, numpy's and torch's global generators exactly
where the same loop written by hand leaves them, with the default logger, model summary,
progress bar, checkpoints and sanity check, and with every library ember imports lazily
imported for the first time during the fit (``rich`` drew from ``random`` when first
imported: a port of Lightning's DQN example got Q-values 0.7% off). And every lazy
import of a third-party library in ember is wrapped so (a static check)."""
import ast
import json
import subprocess
import sys
from pathlib import Path

import ember

ROOT = Path(ember.__file__).resolve().parent
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "rng_untouched.py"


def test_fit_leaves_every_global_rng_where_a_hand_written_loop_does(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=240,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["rich_first_imported_by_fit"]
    assert got["ordered"] == {"python": True, "numpy": True, "torch": True, "weights": True}
    assert got["shuffled"] == {"python": True, "numpy": True, "torch": True, "weights": False}   # ember's order


# -- every lazy import of a third-party library keeps the random streams ------------------------------
# ember/launch and ember/cli run before any user code (the launcher, the CLI's own setup).
# ember/integrations keeps the rule too (transformers, torchmetrics, Ray Train).
EXEMPT = ("launch", "cli")
NOT_THIRD_PARTY = set(sys.stdlib_module_names) | {"ember", "torch", "numpy", "__main__"}


def _third_party(name: str) -> bool:
    return name.split(".")[0] not in NOT_THIRD_PARTY or name.startswith("torch.utils.tensorboard") \
        or name in _EMBER_IMPORTING_AT_TOP


def _top_imports(path: Path) -> list:
    return [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))
            and getattr(n, "level", 0) == 0 and any(
                (a.name if isinstance(n, ast.Import) else (n.module or "")).split(".")[0] not in NOT_THIRD_PARTY
                for a in n.names)]


# ember modules that import a third-party library at their top: importing them lazily counts too
_EMBER_IMPORTING_AT_TOP = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts)
                           for p in ROOT.rglob("*.py") if p.relative_to(ROOT).parts[0] not in ("launch", "cli")
                           and _top_imports(p)}


def _unguarded(path: Path) -> list[str]:
    out = []

    def visit(node, in_function, guarded):
        for child in ast.iter_child_nodes(node):
            fn = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            g = guarded or (isinstance(child, ast.With) and
                            any("keep_rng_states" in ast.unparse(i.context_expr) for i in child.items))
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function and not guarded \
                    and getattr(child, "level", 0) == 0:
                names = [a.name for a in child.names] if isinstance(child, ast.Import) else [child.module or ""]
                if any(_third_party(n) for n in names):
                    out.append(f"{path.relative_to(ROOT.parent)}:{child.lineno}: {ast.unparse(child)}")
            visit(child, fn, g)
    visit(ast.parse(path.read_text()), False, False)
    return out


def test_every_lazy_third_party_import_keeps_the_random_streams():
    """Inside ``with keep_rng_states():`` (ember.checkpoint.rng), and so is a lazy import of
    an ember module that imports a library at its top (only the DeepSpeed checkpoint
    writer does)."""
    bad = [line for p in sorted(ROOT.rglob("*.py")) if p.relative_to(ROOT).parts[0] not in EXEMPT
           for line in _unguarded(p)]
    assert bad == [], "wrap these imports in `with keep_rng_states():`\n" + "\n".join(bad)
    assert _EMBER_IMPORTING_AT_TOP <= {"ember.strategies.deepspeed_writes"}, _EMBER_IMPORTING_AT_TOP


def test_keep_rng_states_restores_each_stream_and_is_a_no_op_off_the_main_thread():
    import random
    import threading

    import numpy as np
    import torch

    from ember.checkpoint.rng import keep_rng_states
    before = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    with keep_rng_states():
        random.random(), np.random.rand(), torch.rand(1)
    assert random.getstate() == before[0] and (np.random.get_state()[1] == before[1]).all()
    assert torch.equal(torch.get_rng_state(), before[2])
    drawn = []

    def other():
        with keep_rng_states():
            drawn.append(random.random())
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert random.getstate() != before[0]   # a writer thread's draw is not undone (nor a training thread's)


def test_import_optional_keeps_the_streams_and_names_the_install(tmp_path, monkeypatch):
    """The one helper for optional packages (MLflow, W&B, Optuna, peft): a first import that
    draws leaves the streams as they were; a missing package is one error naming the install,
    said by ``require_package`` without importing anything."""
    import random

    import pytest
    import torch

    from ember.checkpoint.rng import import_optional, require_package
    from ember.errors import MisconfigurationError
    (tmp_path / "ember_drawing_pkg.py").write_text("import random, torch\nDRAWN = random.random(), torch.rand(1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ember_drawing_pkg", raising=False)
    before = random.getstate(), torch.get_rng_state()
    mod = import_optional("ember_drawing_pkg", "X", 'pip install "ember[x]"')
    assert mod.DRAWN and random.getstate() == before[0] and torch.equal(torch.get_rng_state(), before[1])
    with pytest.raises(ModuleNotFoundError, match=r'^Y needs the `ember_no_such_pkg` package, which is not installed '
                                                 r'\(.*ember_no_such_pkg.*\): pip install "ember\[y\]"$'):
        import_optional("ember_no_such_pkg.sub", "Y", 'pip install "ember[y]"')
    with pytest.raises(MisconfigurationError, match=r'^Z needs the `ember_no_such_pkg` package, which is not '
                                                   r'installed: pip install z$'):
        require_package("ember_no_such_pkg", "Z", "pip install z", error=MisconfigurationError)
    require_package("ember_drawing_pkg", "X", "unused")
