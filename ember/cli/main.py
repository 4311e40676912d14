"""The ``ember`` command line: ``ember fit|validate|test|predict`` build a Trainer, a
TrainModule and a DataModule from YAML files plus dotted overrides and run the
subcommand. See docs/cli.md.
"""
from __future__ import annotations

import argparse
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from ember.callbacks import Callback
from ember.cli.types import (_type_name, _unknown, check_kwargs, instantiate, resolve_class,  # noqa: F401
                             to_yaml_safe)
from ember.errors import UsageError
from ember.launch.command import read_yaml

RUN_COMMANDS = ("fit", "validate", "test", "predict")
TOP_KEYS = ("seed_everything", "trainer", "model", "data", "ckpt_path")

_RUN_EPILOG = """\
overrides (applied after every --config file, in command-line order):
  --trainer.KEY VALUE        a Trainer argument, e.g. --trainer.max_epochs 3
  --model.KEY VALUE          an init argument of the model (same as --model.init_args.KEY)
  --model CLASS              the model class (same as --model.class_path CLASS)
  --data.KEY VALUE           an init argument of the DataModule
  --data CLASS               the DataModule class
  --seed_everything INT|true seed every RNG before the model is built (true: a random seed)
  --ckpt_path PATH|last|best checkpoint to start from
  VALUE is parsed as YAML: 3 -> int, 1e-3 -> float, null -> None, [1, 2] -> list.
  --KEY=VALUE works too.
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit code 2)."""

    hint = ""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"ember: error: {message} (see `{self.hint or self.prog} --help`)\n")


class _RunHelp(argparse.Action):
    """--help for fit/validate/test/predict: also lists the Trainer's arguments."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            from ember.trainer import Trainer
            parser.epilog = _RUN_EPILOG + "\n" + arguments_help(Trainer, "trainer")
        except Exception:  # the Trainer failing to import must not break --help
            pass
        parser.print_help()
        parser.exit()


def arg_docs(obj) -> dict[str, str]:
    """``name -> description`` from the ``Args:`` section of ``obj``'s docstring
    (continuation lines joined)."""
    doc = inspect.getdoc(obj) or ""
    out: dict[str, str] = {}
    inside, name, indent, names = False, None, None, []
    for line in doc.splitlines():
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            inside, indent = True, None
            continue
        if not inside:
            continue
        if not line.strip():
            continue
        lead = len(line) - len(line.lstrip())
        if indent is None:
            indent = lead
        if lead < indent:
            break
        m = re.match(r"\s*(\*{0,2}\w+(?:\s*/\s*\w+)*)\s*(\([^)]*\))?:\s*(.*)", line)
        if lead == indent and m:
            names = [n.strip().lstrip("*") for n in m.group(1).split("/")]   # "monitor / mode: ..."
            for name in names:
                out[name] = m.group(3).strip()
        elif name is not None:
            for name in names:
                out[name] = (out[name] + " " + line.strip()).strip()
    return out


def arguments_help(cls, section: str) -> str:
    """The ``--help`` listing of ``cls``'s init arguments: type, default and the
    description from its docstring, one argument per entry."""
    import textwrap
    sig = inspect.signature(cls)
    docs = arg_docs(cls)
    lines = [f"{section} arguments (--{section}.KEY VALUE or `{section}:` in a config file):"]
    for name, p in sig.parameters.items():
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        tp = p.annotation if p.annotation is not p.empty else "any"
        tp = tp if isinstance(tp, str) else _type_name(tp)
        default = "required" if p.default is p.empty else f"default {p.default!r}"
        lines.append(f"  {name} ({tp}; {default})")
        if docs.get(name):
            lines += textwrap.wrap(docs[name], 76, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    from ember import __version__
    from ember.launch import command as _launch
    fmt = argparse.RawDescriptionHelpFormatter
    p = _Parser(prog="ember", description="ember: train PyTorch models from the command line.",
                formatter_class=fmt, allow_abbrev=False)
    p.add_argument("--version", action="version", version=f"ember {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    blurbs = {"fit": "train a model (and validate it)", "validate": "run the validation loop once",
              "test": "run the test loop", "predict": "run the predict loop"}
    for name in RUN_COMMANDS:
        sp = sub.add_parser(name, help=blurbs[name], formatter_class=fmt, add_help=False,
                            allow_abbrev=False, epilog=_RUN_EPILOG,
                            description=f"{blurbs[name].capitalize()} with a Trainer, a model "
                                        "and a DataModule built from YAML\n(sections trainer:, "
                                        "model:, data:, seed_everything:, ckpt_path:).")
        sp.add_argument("-h", "--help", action=_RunHelp, help="show this help message and exit")
        sp.add_argument("-c", "--config", action="append", default=[], metavar="FILE",
                        help="YAML config; repeat to merge several (later files win)")
        sp.add_argument("--print_config", "--print-config", action="store_true",
                        help="print the fully resolved config (defaults filled in) and exit")
        if name == "predict":
            sp.add_argument("--output", "-o", default=None, metavar="FILE",
                            help="where to save the predictions (torch.save, written atomically; default: "
                                 "predictions.pt in trainer.default_root_dir). Checked before predicting: "
                                 "never an existing file (see --overwrite), never inside a checkpoint or "
                                 "over the weights loaded")
            sp.add_argument("--overwrite", action="store_true",
                            help="replace the --output file if it exists")
    _launch.add_subcommands(sub, fmt)
    from ember.loggers.report import add_subcommand as _add_report
    _add_report(sub, fmt)
    return p


# --------------------------------------------------------------------------- config parsing
def _load_yaml_file(path: str) -> dict:
    data = read_yaml(path, "--config")
    if data is not None and not isinstance(data, dict):
        raise UsageError(f"--config: {path!r} must hold a mapping with keys "
                         f"{', '.join(TOP_KEYS)}; got {type(data).__name__}")
    return data or {}


def _merge(base: dict, new: dict) -> dict:
    """Deep merge; a section naming a different class_path replaces the old one."""
    out = dict(base)
    for key, value in new.items():
        old = out.get(key)
        if isinstance(value, dict) and isinstance(old, dict) and \
                value.get("class_path") in (None, old.get("class_path")):
            out[key] = _merge(old, value)
        else:
            out[key] = value
    return out


def _parse_value(text: str, where: str = "value") -> Any:
    """A command-line value read as YAML (ember's bounded loader); not YAML: the text."""
    import yaml

    from ember.checkpoint.trust import YAMLLimitError, load_yaml
    try:
        return load_yaml(text)
    except YAMLLimitError as err:
        raise UsageError(f"{where}: the value is refused: {err}; ember reads no larger YAML") from None
    except yaml.YAMLError:
        return text


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Pull ``--trainer.x V``, ``--model.y=V``, ``--model CLASS``... out of ``argv``."""
    rest, overrides = [], []
    i = 0
    while i < len(argv):
        tok = argv[i]
        name = tok[2:].split("=", 1)[0] if tok.startswith("--") else ""
        if name.split(".")[0].replace("-", "_") in TOP_KEYS:
            if "=" in tok:
                overrides.append((name, tok.split("=", 1)[1]))
            elif i + 1 < len(argv):
                overrides.append((name, argv[i + 1]))
                i += 1
            else:
                raise UsageError(f"--{name}: expected a value")
        elif "." in name:
            raise UsageError(_unknown(f"--{name.split('.')[0]}", TOP_KEYS, "section"))
        else:
            rest.append(tok)
        i += 1
    return rest, overrides


def apply_override(cfg: dict, dotted: str, raw: str) -> None:
    parts = dotted.split(".")
    parts[0] = parts[0].replace("-", "_")
    value = _parse_value(raw, f"--{dotted}")
    if parts[0] in ("model", "data"):
        if len(parts) == 1:
            parts = [parts[0], "class_path"]
        elif parts[1] not in ("class_path", "init_args"):
            parts.insert(1, "init_args")
    node: Any = cfg
    for i, key in enumerate(parts[:-1]):
        if isinstance(node, list):
            try:
                nxt = node[int(key)]
            except (ValueError, IndexError):
                raise UsageError(f"--{dotted}: {'.'.join(parts[:i])} has no item {key!r}")
        else:
            nxt = node.get(key)
            if isinstance(nxt, str) and i > 0:   # `class_path` given as a plain string
                nxt = node[key] = {"class_path": nxt}
            if not isinstance(nxt, (dict, list)):
                nxt = node[key] = {}
        if isinstance(nxt, dict) and "class_path" in nxt and parts[i + 1] not in ("class_path", "init_args"):
            if not isinstance(nxt.get("init_args"), dict):
                nxt["init_args"] = {}
            nxt = nxt["init_args"]
        node = nxt
    if isinstance(node, list):
        try:
            node[int(parts[-1])] = value
        except (ValueError, IndexError):
            raise UsageError(f"--{dotted}: no item {parts[-1]!r} in the list")
    else:
        node[parts[-1]] = value


def load_config(files: Sequence[str], overrides: Sequence[tuple[str, str]], flat=()) -> dict:
    """Merge the files, then apply the overrides. Sections in ``flat`` (a class fixed by
    the script) may hold init arguments directly."""
    cfg: dict = {}
    for path in files:
        data = _load_yaml_file(path)
        for key in data:
            if key not in TOP_KEYS:
                raise UsageError(_unknown(str(key), TOP_KEYS, "top-level key"))
        for section in ("model", "data"):
            if isinstance(data.get(section), str):
                data[section] = {"class_path": data[section]}
            elif section in flat and isinstance(data.get(section), dict) and \
                    not {"class_path", "init_args"} & set(data[section]):
                data[section] = {"init_args": data[section]}
        cfg = _merge(cfg, data)
    for dotted, raw in overrides:
        apply_override(cfg, dotted, raw)
    return cfg


# --------------------------------------------------------------------------- running
def _trainer_bases() -> dict:
    from ember.callbacks.base import Callback
    from ember.loggers import Logger
    from ember.precision import Precision
    from ember.strategies import Strategy
    return {"callbacks": Callback, "logger": Logger, "strategy": Strategy, "precision": Precision}


def _check_trainer_classes(trainer: dict) -> None:
    """Check every ``class_path`` given as a trainer callback, logger, strategy or precision
    against its base class, before anything is built."""
    for key, base in _trainer_bases().items():
        value = trainer.get(key)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, dict) and "class_path" in item:
                where = f"trainer.{key}" + (f"[{i}]" if isinstance(value, list) else "")
                resolve_class(where, item, base)


class _CLI:
    def __init__(self, model_class=None, datamodule_class=None):
        self.model_class, self.datamodule_class = model_class, datamodule_class
        self.output = None   # `ember predict --output`
        self.overwrite = False   # `ember predict --overwrite`

    def resolve(self, cfg: dict) -> dict:
        from ember.module import DataModule, TrainModule
        from ember.trainer import Trainer
        out: dict[str, Any] = {}
        seed = cfg.get("seed_everything")
        if seed is not None and not isinstance(seed, (bool, int)):
            raise UsageError(f"seed_everything: expected int or bool, got {seed!r}")
        out["seed_everything"] = seed
        trainer = cfg.get("trainer") or {}
        if not isinstance(trainer, dict):
            raise UsageError(f"trainer: expected a mapping of Trainer arguments, got {trainer!r}")
        given = dict(trainer)
        for key, env in (("precision", "EMBER_PRECISION"), ("strategy", "EMBER_STRATEGY")):
            if key not in given and os.environ.get(env):   # set by `ember launch`
                given[key] = os.environ[env]
        _check_trainer_classes(given)
        self.trainer_given = check_kwargs("trainer", Trainer, given, fill_defaults=False)
        out["trainer"] = check_kwargs("trainer", Trainer, given)
        out["model"] = resolve_class("model", cfg.get("model"), TrainModule, self.model_class)
        data = cfg.get("data")
        out["data"] = None if data is None and self.datamodule_class is None else \
            resolve_class("data", data, DataModule, self.datamodule_class)
        ckpt = cfg.get("ckpt_path")
        if ckpt is not None and not isinstance(ckpt, str):
            raise UsageError(f"ckpt_path: expected str, got {ckpt!r}")
        out["ckpt_path"] = ckpt
        return out

    def run(self, command: str, resolved: dict) -> int:
        from ember.trainer import Trainer
        from ember.utilities import seed_everything
        from ember.errors import MisconfigurationError
        seed = resolved["seed_everything"]
        if seed is True:
            seed = _shared_random_seed()
        if seed is not False and seed is not None:
            resolved["seed_everything"] = seed
            seed_everything(seed)
        built = {}
        try:     # a value the classes themselves reject is a config error too
            built["trainer"] = Trainer(**instantiate(self.trainer_given))
            built["model"] = instantiate(resolved["model"])
            built["data"] = instantiate(resolved["data"])
        except MisconfigurationError as err:
            raise UsageError(f"{('trainer', 'model', 'data')[len(built)]}: {err}")
        trainer, model, data = built["trainer"], built["model"], built["data"]
        path = None
        if command == "predict":   # checked before anything is predicted
            path = self.output or os.path.join(trainer.default_root_dir, "predictions.pt")
            self._check_output(path, [resolved["ckpt_path"]])
        trainer.callbacks.append(SaveConfigCallback(to_yaml_safe(resolved)))
        # validate()/test() print their results table themselves (rank 0)
        out = getattr(trainer, command)(model, datamodule=data, ckpt_path=resolved["ckpt_path"])
        if command == "predict" and trainer.is_global_zero:   # every rank holds all predictions
            from ember.callbacks.prediction_writer import save_predictions
            inputs = [resolved["ckpt_path"], getattr(trainer, "ckpt_path", None)]   # "last" -> its path
            try:
                save_predictions(out, path, self.overwrite, inputs, "--output")
            except MisconfigurationError as err:
                raise UsageError(str(err)) from None
            print(f"predictions: {path}")
        return 0

    def _check_output(self, path: str, inputs: list) -> None:
        from ember.checkpoint.trust import check_output_path
        from ember.errors import MisconfigurationError
        try:
            check_output_path(path, self.overwrite, inputs, "--output")
        except MisconfigurationError as err:
            raise UsageError(str(err)) from None


def _shared_random_seed() -> int:
    """`seed_everything: true`: a random seed, the same on every rank of one run."""
    import random
    if os.environ.get("EMBER_GLOBAL_SEED"):         # chosen by the process that started this one
        return int(os.environ["EMBER_GLOBAL_SEED"])
    if os.environ.get("TORCHELASTIC_RUN_ID"):      # under torchrun / `ember launch`
        import zlib
        key = ":".join(os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"))
        return zlib.crc32(key.encode()) % (2**31)
    return random.randint(0, 2**31 - 1)


class SaveConfigCallback(Callback):
    """Writes the resolved CLI config as ``config.yaml`` into the run directory (rank 0)."""

    state_key = "SaveConfigCallback"

    def __init__(self, config: dict):
        self.config, self.saved = config, False

    def setup(self, trainer, module, stage):
        if trainer.is_global_zero and not self.saved:
            import yaml
            path = Path(trainer.log_dir) / "config.yaml"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(yaml.safe_dump(self.config, sort_keys=False))
            self.saved = True


def run_command(args: argparse.Namespace, overrides, cli: _CLI) -> int:
    import yaml
    flat = [k for k, c in (("model", cli.model_class), ("data", cli.datamodule_class)) if c]
    cfg = load_config(args.config, overrides, flat)
    resolved = cli.resolve(cfg)
    if args.print_config:
        sys.stdout.write(yaml.safe_dump(to_yaml_safe(resolved), sort_keys=False))
        return 0
    cli.output = getattr(args, "output", None)
    cli.overwrite = bool(getattr(args, "overwrite", False))
    if cli.output is not None:   # before any object is built
        cli._check_output(cli.output, [resolved["ckpt_path"]])
    return cli.run(args.command, resolved)


def main(argv: Sequence[str] | None = None, *, model_class=None, datamodule_class=None) -> int:
    """Entry point of ``ember`` / ``python -m ember``; returns the exit code.

    Scripts can fix the model / DataModule class (then the ``model:`` section may
    hold its init arguments directly)::

        if __name__ == "__main__":
            raise SystemExit(ember.cli.main(model_class=MyModel, datamodule_class=MyData))
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        overrides: list = []
        if argv and argv[0] in RUN_COMMANDS:
            rest, overrides = split_overrides(argv[1:])
            argv = [argv[0], *rest]
        parser = build_parser()
        parser.hint = f"ember {argv[0]}" if argv and argv[0] in (*RUN_COMMANDS, "launch", "config", "env", "report") else ""
        args = parser.parse_args(argv)
        if args.command in RUN_COMMANDS:
            return run_command(args, overrides, _CLI(model_class, datamodule_class))
        from ember.launch import command as _launch
        if args.command == "launch":
            return _launch.launch(args)
        if args.command == "config":
            return _launch.config_command(args)
        if args.command == "report":
            from ember.loggers.report import report_command
            return report_command(args)
        return _launch.env_command(args)
    except UsageError as err:
        msg = " ".join(str(err).split("\n"))
        print(f"ember: error: {msg}", file=sys.stderr)
        return 2
    except BrokenPipeError:     # `ember env | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
