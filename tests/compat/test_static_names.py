"""The top-level names resolve statically (jedi, which Jupyter and many editors use, and
pyright/mypy through the same stub) while ``import ember`` stays cheap: jedi could not
infer ``from ember import Trainer`` behind a local ``TYPE_CHECKING = False``, and completing
``ember.`` listed none of them."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

import ember

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(ember.__file__)))
STUB = os.path.join(ROOT, "ember", "__init__.pyi")


def _script(source: str):
    jedi = pytest.importorskip("jedi")
    project = jedi.Project(ROOT, sys_path=[ROOT] + sys.path)
    return jedi.Script(source, path=os.path.join(ROOT, "_ide_check.py"), project=project)


def test_stub_lists_exactly_the_lazy_names_and_they_are_the_runtime_objects():
    tree = ast.parse(open(STUB).read())
    stubbed = {a.asname: node.module for node in tree.body if isinstance(node, ast.ImportFrom) for a in node.names}
    assert stubbed == {name: where for name, where in ember._LAZY.items()}
    assert set(ember.__all__) - {"seed_everything", "__version__"} <= set(stubbed)
    for name, where in stubbed.items():
        assert getattr(ember, name) is getattr(__import__(where, fromlist=[name]), name)


def test_jedi_completes_and_infers_the_top_level_names():
    names = {c.name for c in _script("import ember\nember.").complete(2, 6)}
    assert {"Trainer", "TrainModule", "DataModule", "Accelerator", "Fabric", "seed_everything"} <= names
    src = "from ember import Trainer, TrainModule, Accelerator, Fabric\nTrainer\nTrainModule\nAccelerator\nFabric"
    script = _script(src)
    where = {}
    for line, name in enumerate(("Trainer", "TrainModule", "Accelerator", "Fabric"), start=2):
        (d,) = script.infer(line, 1)
        assert d.name == name and d.type == "class"
        where[name] = os.path.relpath(str(d.module_path), ROOT)
        assert d.docstring().strip()                    # help text reaches the IDE
    assert where == {"Trainer": os.path.join("ember", "trainer", "trainer.py"),
                     "TrainModule": os.path.join("ember", "module.py"),
                     "Accelerator": os.path.join("ember", "accelerator", "accelerator.py"),
                     "Fabric": os.path.join("ember", "compat", "fabric.py")}
    # and a method of an instance completes
    done = {c.name for c in _script("import ember\nember.Trainer(max_epochs=1).fi").complete(2, 30)}
    assert "fit" in done


def test_import_ember_stays_cheap():
    code = "import sys, ember; print(sorted(m for m in ('torch', 'typing_extensions', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
