"""A config file or command-line value from anyone: YAML is read within ember's bounds (a
"billion laughs" file or a deep one is one ``ember: error:`` line with exit code 2, at
once), and a ``class_path`` imports no standard-library module and nothing from the
working directory unless the user's own module is named there."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from helpers import EXAMPLES, one_line_error

EXAMPLE = EXAMPLES / "cli"


def laughs(levels: int = 9) -> str:
    """A YAML anchor chain whose aliases expand to 9**levels strings (under 1 KB of text)."""
    out = '  a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    for i in range(1, levels):
        out += f"  a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]\n"
    return out


def ember(*args, cwd, timeout=60, pythonpath=str(EXAMPLE)):
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env.update(XDG_CONFIG_HOME=str(Path(cwd) / "xdg"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "ember", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


# --------------------------------------------------------------------------- YAML bounds
def test_billion_laughs_config_is_refused_at_once(tmp_path):
    text = ("model:\n  class_path: toy.ToyRegressor\n  init_args:\n    hidden: 2\n"
            "trainer:\n  max_steps: 1\n  plugins:\n" + laughs().replace("\n  ", "\n    ").replace("  a0", "    a0", 1))
    assert len(text) < 1024
    (tmp_path / "lol.yaml").write_text(text)
    start = time.monotonic()
    line = one_line_error(ember("fit", "--config", "lol.yaml", "--print_config", cwd=tmp_path))
    assert time.monotonic() - start < 30
    assert "--config: 'lol.yaml' is refused: its aliases expand to more than 200000 values" in line, line


def test_deep_config_is_one_line_not_a_recursion_error(tmp_path, cli):
    (tmp_path / "deep.yaml").write_text("model:\n  class_path: toy.ToyRegressor\n  init_args:\n    hidden: "
                                        + "[" * 30000 + "]" * 30000 + "\n")
    line = one_line_error(cli("fit", "--config", "deep.yaml", "--print_config"))
    assert "--config: 'deep.yaml' is refused: it nests deeper than 64 levels" in line, line


def test_alias_chains_that_nest_deep_are_refused(tmp_path, cli):
    """Each anchor nests only 8 levels, but each wraps the one before: expanded, 320 levels."""
    text = "trainer:\n  plugins:\n"
    for i in range(40):
        text += f"    - &d{i} " + "[" * 8 + (f"*d{i - 1}" if i else "0") + "]" * 8 + "\n"
    (tmp_path / "chain.yaml").write_text(text)
    line = one_line_error(cli("fit", "--config", "chain.yaml", "--print_config"))
    assert "with its aliases expanded it nests deeper than 64 levels" in line, line


def test_recursive_alias_is_refused(tmp_path, cli):
    (tmp_path / "loop.yaml").write_text("trainer:\n  plugins: &x [*x]\n")
    line = one_line_error(cli("fit", "--config", "loop.yaml", "--print_config"))
    assert "the alias *x refers to a node that holds it" in line, line


def test_billion_laughs_command_line_value_is_refused(tmp_path, cli):
    value = "{" + laughs().replace("\n", ", ").strip(", ") + "}"
    line = one_line_error(cli("fit", "--config", EXAMPLE / "config.yaml", "--trainer.plugins", value,
                              "--print_config"))
    assert line.startswith("ember: error: --trainer.plugins: the value is refused: its aliases expand"), line


def test_launch_config_file_uses_the_same_bounds(tmp_path, cli):
    (tmp_path / "launch.yaml").write_text("deepspeed_config:\n" + laughs())
    line = one_line_error(cli("launch", "--config_file", "launch.yaml", "x.py"))
    assert "--config_file: 'launch.yaml' is refused: its aliases expand" in line, line


def test_ordinary_anchors_still_work(tmp_path, cli):
    import yaml
    (tmp_path / "ok.yaml").write_text("model:\n  class_path: toy.ToyRegressor\n  init_args: &m {hidden: 3}\n"
                                      "data:\n  class_path: toy.ToyData\n  init_args:\n    num_samples: 32\n")
    r = cli("fit", "--config", "ok.yaml", "--print_config")
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["model"]["init_args"]["hidden"] == 3


# --------------------------------------------------------------------------- class paths
def test_a_standard_library_class_path_is_refused_before_it_is_imported(tmp_path):
    (tmp_path / "zen.yaml").write_text("model:\n  class_path: this.NotAClass\n")
    r = ember("fit", "--config", "zen.yaml", "--print_config", cwd=tmp_path)
    assert "Beautiful is better than ugly" not in r.stdout + r.stderr      # `import this` never ran
    line = one_line_error(r)
    assert "model.class_path: 'this.NotAClass' names the standard-library module 'this'" in line, line


def test_the_working_directory_shadows_nothing_ember_imports(tmp_path):
    """A downloaded folder holding a module named like one ember imports later (tqdm, yaml,
    numpy...): running ember there never imports it; the user's own module named by the
    config, found only in that folder, still is (with its neighbours)."""
    marker = tmp_path / "shadow-ran"
    for name in ("tqdm", "numpy", "yaml"):
        (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r})\n")
    (tmp_path / "toy_helpers.py").write_text("HIDDEN = 3\n")
    (tmp_path / "mytoy.py").write_text((EXAMPLE / "toy.py").read_text() + "\nfrom toy_helpers import HIDDEN\n")
    (tmp_path / "cfg.yaml").write_text("model:\n  class_path: mytoy.ToyRegressor\n  init_args: {hidden: 3}\n"
                                       "data:\n  class_path: mytoy.ToyData\n")
    r = ember("fit", "--config", "cfg.yaml", "--print_config", cwd=tmp_path, pythonpath="")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "class_path: mytoy.ToyRegressor" in r.stdout
    assert not marker.exists(), marker.read_text()


def test_every_yaml_read_in_ember_goes_through_the_bounded_loader():
    import re

    import ember
    root = Path(ember.__file__).parent
    raw = re.compile(r"\byaml\.(safe_load|load|full_load|unsafe_load|load_all|safe_load_all)\(")
    hits = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if p.name != "trust.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if raw.search(line)]
    assert hits == [], f"read YAML with ember.checkpoint.trust.load_yaml: {hits}"
