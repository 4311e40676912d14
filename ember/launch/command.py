"""`ember launch`, `ember config` and `ember env`.

``ember launch`` is a thin translation layer over torchrun's elastic agent
(:mod:`torch.distributed.run`): ember's flags (and the defaults saved by
``ember config``) become torchrun arguments, and the precision and strategy
choices are exported to every worker as environment variables (the list: docs/cli.md,
"Environment variables for the workers").

The Trainer and the Accelerator read them as defaults when their own argument
is left at ``"auto"`` / its default. An explicit argument always wins.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

from ember.errors import UsageError

PRECISION_ENV = {"no": "32-true", "fp16": "16-mixed", "bf16": "bf16-mixed"}
STRATEGIES = ("no", "ddp", "fsdp", "deepspeed")
ENVIRONMENTS = ("local_machine", "multi_machine")
RDZV_BACKENDS = ("static", "c10d")
OFFLOAD = ("none", "cpu")
#: default of ``--rdzv_timeout``: seconds the machines wait for each other at the start (torch's default)
RDZV_TIMEOUT_S = 600.0

DEFAULTS: dict[str, Any] = {
    "compute_environment": "local_machine",
    "num_machines": 1,
    "machine_rank": 0,
    "main_process_ip": None,
    "main_process_port": None,
    "rdzv_backend": "static",
    "num_processes": 1,
    "strategy": "no",
    "mixed_precision": "no",
    "fsdp_config": {"reshard_after_forward": True, "cpu_offload": False},
    "deepspeed_config": {"zero_stage": 2, "offload_optimizer_device": "none",
                         "offload_param_device": "none"},
}


def default_config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "ember" / "default_config.yaml"


# --------------------------------------------------------------------------- config file
def _check_choice(key: str, value: Any, choices) -> Any:
    if value not in choices:
        raise UsageError(f"{key}: {value!r} is not valid; choose one of: "
                         + ", ".join(repr(c) for c in choices))
    return value


def _check_int(key: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"{key}: expected int, got {value!r}")
    if value < minimum:
        raise UsageError(f"{key}: expected an int >= {minimum}, got {value}")
    return value


def _check_port(key: str, value: Any) -> int:
    _check_int(key, value, 0)
    if not 1 <= value <= 65535:
        raise UsageError(f"{key}: {value} is not a TCP port (1 to 65535)"
                         + ("; 0 would ask the system for any free port, which the other processes cannot know: "
                            "leave the port out on one machine to get a free one" if value == 0 else ""))
    return value


def _check_host(key: str, value: Any) -> str:
    """An IP address (v4 or v6) or a host name, as the other machines will dial it."""
    import ipaddress
    import re
    if isinstance(value, str):
        try:
            ipaddress.ip_address(value[1:-1] if value.startswith("[") and value.endswith("]") else value)
            return value
        except ValueError:
            labels = value[:-1].split(".") if value.endswith(".") else value.split(".")
            if 0 < len(value) <= 253 and all(re.fullmatch(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?", label)
                                             for label in labels):
                return value
    raise UsageError(f"{key}: {value!r} is not an IP address or a host name (e.g. 10.0.0.1 or node-0)")


def _check_keys(where: str, data: dict, valid) -> None:
    import difflib
    for key in data:
        if key not in valid:
            close = difflib.get_close_matches(str(key), list(valid), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(f"{where}{key}: unknown key{hint}; valid keys: " + ", ".join(valid))


def read_yaml(path: "str | Path", flag: str) -> Any:
    """A YAML file read with ember's bounded loader (:func:`ember.checkpoint.trust.load_yaml`:
    no alias expansion past its size, no nesting past its depth); a problem becomes a
    one-line error naming ``flag``."""
    import yaml

    from ember.checkpoint.trust import YAMLLimitError, load_yaml
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"{flag}: cannot read {str(path)!r}: {getattr(err, 'strerror', None) or err}")
    try:
        return load_yaml(text)
    except YAMLLimitError as err:
        raise UsageError(f"{flag}: {str(path)!r} is refused: {err}; ember reads no larger YAML")
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or "syntax error"
        raise UsageError(f"{flag}: {str(path)!r} is not valid YAML{where}: {problem}")


def load_launch_config(path: "str | Path") -> dict:
    """Read and validate a launch config file (the one ``ember config`` writes)."""
    data = read_yaml(path, "--config_file") or {}
    from ember.launch.accelerate_flags import from_accelerate_config, is_accelerate_config
    extras: dict = {}
    if is_accelerate_config(data):   # a file written by `accelerate config`
        data, extras = from_accelerate_config(data)
    if not isinstance(data, dict):
        raise UsageError(f"--config_file: {str(path)!r} must hold a mapping, got {type(data).__name__}")
    _check_keys("config_file: ", data, DEFAULTS)
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in DEFAULTS.items()}
    for key in ("fsdp_config", "deepspeed_config"):
        section = data.pop(key, None) or {}
        if not isinstance(section, dict):
            raise UsageError(f"config_file: {key}: expected a mapping, got {section!r}")
        _check_keys(f"config_file: {key}.", section, DEFAULTS[key])
        out[key].update(section)
    out.update(data)
    for key in ("strategy", "mixed_precision"):
        if out[key] is False:      # YAML 1.1 reads an unquoted `no` as false
            out[key] = "no"
    out["_given"] = set(data)      # keys the file sets (precision/strategy are exported only then)
    out["_accelerate"] = extras
    return out


def validate_launch_config(cfg: dict) -> dict:
    _check_choice("compute_environment", cfg["compute_environment"], ENVIRONMENTS)
    _check_int("num_machines", cfg["num_machines"], 1)
    _check_int("machine_rank", cfg["machine_rank"], 0)
    _check_int("num_processes", cfg["num_processes"], 1)
    if cfg["num_processes"] % cfg["num_machines"]:
        raise UsageError(f"num_processes: {cfg['num_processes']} is the total over all machines (as in "
                         f"Accelerate) and does not divide by num_machines ({cfg['num_machines']}); give a "
                         f"multiple of {cfg['num_machines']}, e.g. "
                         f"{cfg['num_machines'] * max(1, cfg['num_processes'] // cfg['num_machines'])}, "
                         "or --nproc_per_node for the count per machine")
    if cfg["machine_rank"] >= cfg["num_machines"]:
        raise UsageError(f"machine_rank: {cfg['machine_rank']} must be below num_machines "
                         f"({cfg['num_machines']})")
    if cfg["main_process_port"] is not None:
        _check_port("main_process_port", cfg["main_process_port"])
    if cfg["main_process_ip"] is not None:
        _check_host("main_process_ip", cfg["main_process_ip"])
    _check_choice("rdzv_backend", cfg["rdzv_backend"], RDZV_BACKENDS)
    _check_choice("strategy", cfg["strategy"], STRATEGIES)
    _check_choice("mixed_precision", cfg["mixed_precision"], tuple(PRECISION_ENV))
    fsdp, ds = cfg["fsdp_config"], cfg["deepspeed_config"]
    for key in ("reshard_after_forward", "cpu_offload"):
        if not isinstance(fsdp[key], bool):
            raise UsageError(f"fsdp_config.{key}: expected bool, got {fsdp[key]!r}")
    _check_choice("deepspeed_config.zero_stage", ds["zero_stage"], (1, 2, 3))
    _check_choice("deepspeed_config.offload_optimizer_device", ds["offload_optimizer_device"], OFFLOAD)
    _check_choice("deepspeed_config.offload_param_device", ds["offload_param_device"], OFFLOAD)
    if cfg["num_machines"] > 1 and cfg["main_process_ip"] is None:
        raise UsageError("--main-process-ip is required when --num-machines > 1")
    least = cfg.get("min_machines")
    if least is not None and least < cfg["num_machines"] and cfg["rdzv_backend"] != "c10d":
        raise UsageError(f"--num_machines {least}:{cfg['num_machines']}: a group of MIN to MAX machines needs "
                         "--rdzv_backend c10d (the static rendezvous waits for every machine rank)")
    return cfg


def worker_env(cfg: dict) -> dict[str, "str | None"]:
    """The EMBER_* variables exported to the workers (None: remove). Precision and
    strategy only when a flag or the config file gave them."""
    given = cfg.get("_given", set(cfg))
    env: dict[str, "str | None"] = {}
    if "mixed_precision" in given:
        env["EMBER_PRECISION"] = PRECISION_ENV[cfg["mixed_precision"]]
    if "strategy" not in given:
        return env
    strategy = cfg["strategy"]
    env["EMBER_STRATEGY"] = None if strategy == "no" else strategy
    fsdp, ds = cfg["fsdp_config"], cfg["deepspeed_config"]
    on = strategy == "fsdp"
    env["EMBER_FSDP_RESHARD_AFTER_FORWARD"] = str(int(fsdp["reshard_after_forward"])) if on else None
    env["EMBER_FSDP_CPU_OFFLOAD"] = str(int(fsdp["cpu_offload"])) if on else None
    on = strategy == "deepspeed"
    env["EMBER_DEEPSPEED_ZERO_STAGE"] = str(ds["zero_stage"]) if on else None
    env["EMBER_DEEPSPEED_OFFLOAD_OPTIMIZER"] = ds["offload_optimizer_device"] if on else None
    env["EMBER_DEEPSPEED_OFFLOAD_PARAMS"] = ds["offload_param_device"] if on else None
    return env


# --------------------------------------------------------------------------- launch
class _Machines(argparse.Action):
    """``--num_machines M`` or ``MIN:MAX`` (torchrun's elastic ``--nnodes``): ``num_machines``
    is the most machines, ``min_machines`` the fewest the group goes on with (None: fixed)."""

    def __call__(self, parser, namespace, values, option_string=None):
        low, sep, high = str(values).partition(":")
        try:
            most, least = int(high if sep else low), (int(low) if sep else None)
        except ValueError:
            raise argparse.ArgumentError(self, f"expected a number of machines or MIN:MAX, got {values!r}") from None
        if least is not None and not 1 <= least <= most:
            raise argparse.ArgumentError(self, f"MIN:MAX needs 1 <= MIN <= MAX, got {values!r}")
        namespace.num_machines, namespace.min_machines = most, least


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config_file", "--config-file", default=None, metavar="PATH",
                   help="launch defaults written by `ember config` (default: the file at "
                        "$XDG_CONFIG_HOME/ember/default_config.yaml when it exists); flags override it")
    g = p.add_argument_group("topology")
    g.add_argument("--num-processes", "--num_processes", dest="num_processes", type=int, metavar="N",
                   help="processes in total, over all machines (as in Accelerate); each machine runs "
                        "N / M of them")
    g.add_argument("--nproc_per_node", "--nproc-per-node", dest="nproc_per_node", type=int, metavar="K",
                   help="processes per machine (torchrun's option); the same as --num-processes K*M")
    g.add_argument("--num-machines", "--num_machines", "--nnodes", dest="num_machines", action=_Machines,
                   metavar="M", help="number of machines, or MIN:MAX for an elastic group that goes on with "
                                     "MIN to MAX machines (with --rdzv_backend c10d)")
    p.set_defaults(min_machines=None)
    g.add_argument("--machine-rank", "--machine_rank", "--node_rank", "--node-rank",
                   dest="machine_rank", type=int, metavar="R", help="rank of this machine (0 .. M-1)")
    g.add_argument("--main-process-ip", "--main_process_ip", "--master_addr", "--master-addr",
                   dest="main_process_ip", metavar="IP", help="address of machine 0")
    g.add_argument("--main-process-port", "--main_process_port", "--master_port", "--master-port",
                   dest="main_process_port", type=int, metavar="PORT",
                   help="port of machine 0 (default 29500 on several machines; a free port on one)")
    g.add_argument("--rdzv_backend", "--rdzv-backend", dest="rdzv_backend", choices=RDZV_BACKENDS,
                   help="static: fixed machine ranks (default); c10d: elastic rendezvous at IP:PORT")
    g.add_argument("--rdzv_id", "--rdzv-id", dest="rdzv_id", default="ember",
                   help="job id shared by all machines (c10d only)")
    g = p.add_argument_group("training")
    g.add_argument("--mixed_precision", "--mixed-precision", choices=tuple(PRECISION_ENV),
                   help="exported as EMBER_PRECISION (no=32-true, fp16=16-mixed, bf16=bf16-mixed)")
    g.add_argument("--strategy", choices=STRATEGIES, help="exported as EMBER_STRATEGY")
    g.add_argument("--fsdp_reshard_after_forward", choices=("true", "false"))
    g.add_argument("--fsdp_cpu_offload", choices=("true", "false"))
    g.add_argument("--zero_stage", type=int, choices=(1, 2, 3))
    g.add_argument("--offload_optimizer_device", choices=OFFLOAD)
    g.add_argument("--offload_param_device", choices=OFFLOAD)
    g = p.add_argument_group("agent (passed to torchrun)")
    g.add_argument("--max_restarts", "--max-restarts", type=int, default=0,
                   help="restart the worker group this many times after a failure (default 0)")
    g.add_argument("--monitor_interval", "--monitor-interval", type=float, default=0.1,
                   help="seconds between the agent's checks of its workers (default 0.1)")
    g.add_argument("--rdzv_timeout", "--rdzv-timeout", type=float, default=RDZV_TIMEOUT_S, metavar="SECONDS",
                   help="how long machine 0 waits for the other machines to join (and they for it) before "
                        f"the launch fails (default {RDZV_TIMEOUT_S:g})")
    g.add_argument("-m", "--module", action="store_true",
                   help="run SCRIPT as a module, like `python -m` (e.g. `-m ember fit ...`)")
    g.add_argument("--no_python", "--no-python", action="store_true",
                   help="run SCRIPT directly as an executable")
    g.add_argument("--log_dir", "--log-dir", default=None, help="torchrun's log directory")
    from ember.launch.accelerate_flags import add_accelerate_arguments
    add_accelerate_arguments(p)
    p.add_argument("training_script", metavar="SCRIPT", help="the script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...",
                   help="arguments for the script")


def add_subcommands(sub, fmt) -> None:
    """The ``launch``, ``config`` and ``env`` subcommands of the ``ember`` parser."""
    lp = sub.add_parser("launch", help="run a script on several processes / machines (torchrun)",
                        formatter_class=fmt, allow_abbrev=False,
                        description="Start SCRIPT on --num-processes processes in total (over all "
                                    "--num-machines machines, as in Accelerate) with\ntorchrun's elastic "
                                    "agent. Each process gets RANK, LOCAL_RANK, "
                                    "WORLD_SIZE, MASTER_ADDR, MASTER_PORT,\nplus EMBER_PRECISION and "
                                    "EMBER_STRATEGY (read by the Trainer and the Accelerator).\n"
                                    "Values from --config_file (or the default config) are defaults;"
                                    " flags override them.",
                        epilog="examples:\n  ember launch --num-processes 2 train.py --lr 1e-3\n"
                               "  ember launch --num-processes 2 -m ember fit --config cfg.yaml\n"
                               "  ember launch --num-machines 2 --machine-rank 0 --main-process-ip "
                               "10.0.0.1 --main-process-port 29500 --num-processes 16 train.py   # 8 per machine")
    add_launch_arguments(lp)
    cp = sub.add_parser("config", help="write the default launch config (interactive)",
                        formatter_class=fmt, allow_abbrev=False,
                        description="Ask how to launch (machines, processes, strategy, precision)"
                                    "\nand save the answers as the defaults of `ember launch`.")
    cp.add_argument("--config_file", "--config-file", default=None, metavar="PATH",
                    help="where to write (default: $XDG_CONFIG_HOME/ember/default_config.yaml, "
                         "~/.config/ember/default_config.yaml when XDG_CONFIG_HOME is unset)")
    cp.add_argument("--default", action="store_true",
                    help="write a config for this machine without asking (one process per GPU)")
    sub.add_parser("env", help="print versions and hardware for a bug report", allow_abbrev=False)


def resolve_launch_config(args: argparse.Namespace) -> dict:
    path = args.config_file
    if path is None and default_config_path().is_file():
        path = default_config_path()
    cfg = load_launch_config(path) if path is not None else \
        {k: (dict(v) if isinstance(v, dict) else v) for k, v in DEFAULTS.items()}
    cfg.setdefault("_given", set())
    for key in ("num_processes", "num_machines", "machine_rank", "main_process_ip",
                "main_process_port", "rdzv_backend", "strategy", "mixed_precision"):
        value = getattr(args, key)
        if value is not None:
            cfg[key] = value
            cfg["_given"].add(key)
    for flag, key in (("fsdp_reshard_after_forward", "reshard_after_forward"),
                      ("fsdp_cpu_offload", "cpu_offload")):
        if getattr(args, flag) is not None:
            cfg["fsdp_config"][key] = getattr(args, flag) == "true"
    for flag in ("zero_stage", "offload_optimizer_device", "offload_param_device"):
        if getattr(args, flag) is not None:
            cfg["deepspeed_config"][flag] = getattr(args, flag)
    from ember.launch.accelerate_flags import apply_accelerate_flags
    _check_int("num_machines", cfg["num_machines"], 1)
    per_node = getattr(args, "nproc_per_node", None)
    if per_node is not None:
        _check_int("--nproc_per_node", per_node, 1)
        total = per_node * cfg["num_machines"]
        if getattr(args, "num_processes", None) not in (None, total):
            raise UsageError(f"launch: --nproc_per_node {per_node} on {cfg['num_machines']} machine(s) is "
                             f"{total} processes in total, but --num_processes says {args.num_processes}; "
                             "give one of them")
        cfg["num_processes"] = total
        cfg["_given"].add("num_processes")
    if "num_processes" not in cfg["_given"]:
        cfg["num_processes"] = cfg["num_machines"]   # one per machine
    if getattr(args, "min_machines", None) is not None:
        cfg["min_machines"] = args.min_machines   # --num_machines MIN:MAX (flag only)
    apply_accelerate_flags(cfg, args)
    if cfg["num_machines"] > 1:
        cfg["compute_environment"] = "multi_machine"
    return validate_launch_config(cfg)


def processes_per_machine(cfg: dict) -> int:
    """The processes each machine starts: ``num_processes`` is the total over all
    machines, as in Accelerate (``validate_launch_config`` refused a total that does not
    divide by ``num_machines``)."""
    return cfg["num_processes"] // cfg["num_machines"]


def check_agent_args(args: argparse.Namespace) -> None:
    """The agent's own flags (``--max_restarts``, ``--monitor_interval``, ``--rdzv_timeout``)."""
    import math
    _check_int("--max_restarts", getattr(args, "max_restarts", 0), 0)
    for flag in ("monitor_interval", "rdzv_timeout"):
        value = getattr(args, flag, None)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UsageError(f"--{flag}: expected a number of seconds > 0, got {value:g}")


def torchrun_argv(cfg: dict, args: argparse.Namespace) -> list[str]:
    """The torchrun options (and script) of an ``ember launch`` call; the script's
    own arguments are added after parsing."""
    least = cfg.get("min_machines")
    nnodes = f"{least}:{cfg['num_machines']}" if least is not None and least < cfg["num_machines"] \
        else cfg["num_machines"]
    argv = [f"--nnodes={nnodes}", f"--nproc-per-node={processes_per_machine(cfg)}",
            f"--max-restarts={args.max_restarts}", f"--monitor-interval={args.monitor_interval}"]
    port = cfg["main_process_port"]
    timeout = max(1, math.ceil(getattr(args, "rdzv_timeout", None) or RDZV_TIMEOUT_S))
    if cfg["num_machines"] == 1 and port is None:
        argv.append("--standalone")  # c10d store on a free local port
    elif cfg["rdzv_backend"] == "static":
        argv += ["--rdzv-backend=static", f"--node-rank={cfg['machine_rank']}",
                 f"--master-addr={cfg['main_process_ip'] or '127.0.0.1'}",
                 f"--master-port={29500 if port is None else port}", f"--rdzv-conf=timeout={timeout}"]
    else:
        argv += ["--rdzv-backend=c10d",
                 f"--rdzv-endpoint={cfg['main_process_ip'] or '127.0.0.1'}:{29500 if port is None else port}",
                 f"--rdzv-id={args.rdzv_id}", f"--rdzv-conf=join_timeout={timeout}"]
    if args.module:
        argv.append("--module")
    if args.no_python:
        argv.append("--no-python")
    if args.log_dir:
        argv.append(f"--log-dir={args.log_dir}")
    return argv + [args.training_script]


def hosts_the_rendezvous(cfg: dict) -> bool:
    """Whether this machine's agent opens the rendezvous port (machine 0 of a static
    rendezvous, or a single machine given a port)."""
    if cfg["main_process_port"] is None and cfg["num_machines"] == 1:
        return False       # --standalone: torchrun picks a free port
    return cfg["rdzv_backend"] == "static" and cfg["machine_rank"] == 0


def check_port_free(cfg: dict) -> None:
    """Before starting, on the machine that opens the rendezvous port: that port must be
    free here, else a second agent (two machines both given machine_rank 0 on one host,
    or a run still going) fails at once rather than after the agents waited for it."""
    import errno
    import socket
    if not hosts_the_rendezvous(cfg):
        return
    port = 29500 if cfg["main_process_port"] is None else cfg["main_process_port"]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as torch's store: TIME_WAIT is no use
        try:
            s.bind(("", port))
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                return          # another problem: torch's own store reports it
            raise UsageError(_port_in_use(cfg, port)) from None


def _port_in_use(cfg: dict, port: int) -> str:
    return (f"launch: --main_process_port {port} is already in use on this machine, which opens the rendezvous "
            f"as machine_rank {cfg['machine_rank']}: another `ember launch` given machine_rank 0 (each machine "
            "needs its own --machine_rank), a run still going, or another program holds it; give a free port "
            "or stop that process")


def _rendezvous_error(err: BaseException, cfg: dict, args: argparse.Namespace) -> str:
    """One line for a rendezvous that failed: the port taken, or machines that never came."""
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    port = 29500 if cfg["main_process_port"] is None else cfg["main_process_port"]
    where = f"{cfg['main_process_ip'] or '127.0.0.1'}:{port}"
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return _port_in_use(cfg, port)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return (f"launch: the {cfg['num_machines']} machines did not all join the rendezvous at {where} within "
                f"--rdzv_timeout {args.rdzv_timeout:g} s ({text}); start `ember launch` on every machine with "
                f"--num_machines {cfg['num_machines']}, its own --machine_rank (0 to {cfg['num_machines'] - 1}) "
                f"and the same --main_process_ip/--main_process_port, reachable from all of them")
    return f"launch: the rendezvous at {where} failed: {type(err).__name__}: {text}"


def launch(args: argparse.Namespace) -> int:
    check_agent_args(args)
    cfg = resolve_launch_config(args)
    if not (args.module or args.no_python) and not os.path.isfile(args.training_script):
        raise UsageError(f"launch: script {args.training_script!r} not found "
                         "(use -m to run a module)")
    check_port_free(cfg)
    from ember.launch.accelerate_flags import accelerate_env
    for key, value in {**worker_env(cfg), **accelerate_env(cfg)}.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if getattr(args, "max_restarts", 0):
        # a restarted worker group resumes fit() from the newest complete checkpoint
        os.environ["EMBER_ELASTIC_RESUME"] = "1"
    from torch.distributed import DistError
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    try:
        run_args = torchrun.parse_args(torchrun_argv(cfg, args))
        # set after parsing: torchrun's parser would try to match script flags to its options
        run_args.training_script_args = list(args.script_args)
        torchrun.run(run_args)
    except ChildFailedError as err:
        rank, failure = first_failure(err.failures)
        if failure.exitcode < 0:
            how = f"was killed by signal {failure.signal_name()}"
            code = 128 - failure.exitcode
        else:
            how = f"exited with code {failure.exitcode}"
            code = failure.exitcode or 1
        missing = _never_arrived(failure)
        if missing:
            print(f"ember: error: launch: rank(s) {missing} never arrived at a collective: rank {rank} (local rank "
                  f"{failure.local_rank}) waited for them until the process-group timeout and {how}; its error is "
                  "printed above", file=sys.stderr)
        elif len(tied := unordered_failures(err.failures)) > 1:
            print(f"ember: error: launch: ranks {', '.join(map(str, tied))} {how.replace('was', 'were')} within the "
                  "same second and none recorded its error (a script that does not use ember records none), so "
                  "which failed first cannot be told; their errors are printed above", file=sys.stderr)
        else:
            print(f"ember: error: launch: rank {rank} (local rank {failure.local_rank}) {how}; "
                  "its error is printed above", file=sys.stderr)
        return code
    except SignalException as err:
        print(f"ember: error: launch: stopped by signal {err.sigval.name}", file=sys.stderr)
        return 128 + int(err.sigval)
    except (DistError, RendezvousError) as err:    # the agents' rendezvous, before any worker ran
        print(f"ember: error: {_rendezvous_error(err, cfg, args)}", file=sys.stderr)
        return 1
    return 0


def _never_arrived(failure) -> str:
    """The ranks a failed rank's recorded error says never arrived at a collective
    (``"1"``, ``"1, 3"``), or ``""``."""
    import re
    data = getattr(failure, "error_file_data", None) or {}
    message = data.get("message") if isinstance(data, dict) else None
    text = message.get("message", "") if isinstance(message, dict) else str(message or "")
    m = re.search(r"rank\(s\) ([\d, ]+?) never arrived", text if isinstance(text, str) else "")
    return m.group(1) if m else ""


def first_failure(failures: dict) -> tuple:
    """The (global rank, failure) that started a failed job, from torchrun's failures.

    A rank that raised records its error (ember's excepthook writes torchrun's error file,
    with the time it failed); the ranks stopped because of it (killed by the agent's
    SIGTERM, or reporting that a peer went away, which writes no error file) come after.
    So: the earliest recorded error; else the earliest exit with a code; else any."""
    return min(failures.items(), key=_failure_order)


def _failure_order(item) -> tuple:
    rank, f = item
    data = getattr(f, "error_file_data", None) or {}
    recorded = isinstance(data.get("message"), dict)   # written by ErrorHandler (torchrun's "<NONE>" if not)
    return (0 if recorded else 1 if f.exitcode > 0 else 2, f.timestamp, rank)


def unordered_failures(failures: dict) -> list:
    """The global ranks that :func:`first_failure` cannot order: each exited with a code
    in the same second as the first, and none recorded an error (a plain torch script:
    the rank that raised and the one that then lost its peer look alike). One rank when
    the first failure is known."""
    first = _failure_order(min(failures.items(), key=_failure_order))
    if first[0] != 1:
        return [min(failures.items(), key=_failure_order)[0]]
    return sorted(r for r, f in failures.items() if _failure_order((r, f))[:2] == first[:2])


# --------------------------------------------------------------------------- config wizard
def default_launch_config() -> dict:
    """1 machine, one process per local GPU (or 1), ddp when that is more than one."""
    try:
        import torch
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # pragma: no cover - broken CUDA driver
        n = 0
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in DEFAULTS.items()}
    cfg["num_processes"] = max(n, 1)
    cfg["strategy"] = "ddp" if n > 1 else "no"
    return cfg


def _ask_int(question: str, default: int, minimum: int, maximum: "int | None" = None) -> int:
    from rich.prompt import IntPrompt
    while True:
        value = IntPrompt.ask(question, default=default)
        if value >= minimum and (maximum is None or value <= maximum):
            return value
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        print(f"Please enter a number {bound}")


def wizard() -> dict:
    """Ask the launch questions on the terminal (or from scripted stdin)."""
    from rich.prompt import Confirm, Prompt
    cfg = default_launch_config()
    env = Prompt.ask("Which compute environment are you running in?", choices=list(ENVIRONMENTS),
                     default="local_machine")
    cfg["compute_environment"] = env
    if env == "multi_machine":
        cfg["num_machines"] = _ask_int("How many machines?", 2, 1)
        cfg["machine_rank"] = _ask_int("What is the rank of this machine?", 0, 0,
                                       cfg["num_machines"] - 1)
        cfg["main_process_ip"] = Prompt.ask("What is the IP address of the main machine (rank 0)?",
                                            default="127.0.0.1")
        cfg["main_process_port"] = _ask_int("What port does the main machine listen on?",
                                            29500, 1, 65535)
    while True:
        cfg["num_processes"] = _ask_int("How many processes in total, over all machines (usually one per GPU)?",
                                        cfg["num_processes"] * cfg["num_machines"], 1)
        if cfg["num_processes"] % cfg["num_machines"] == 0:
            break
        print(f"Please enter a multiple of the number of machines ({cfg['num_machines']})")
    strategy = Prompt.ask("Which distributed strategy?", choices=list(STRATEGIES),
                          default="ddp" if cfg["num_processes"] > 1 else "no")
    cfg["strategy"] = strategy
    if strategy == "fsdp":
        cfg["fsdp_config"] = {
            "reshard_after_forward": Confirm.ask(
                "FSDP: reshard parameters after forward (less memory, more communication)?",
                default=True),
            "cpu_offload": Confirm.ask("FSDP: offload parameters and gradients to CPU?",
                                       default=False)}
    elif strategy == "deepspeed":
        ds = cfg["deepspeed_config"]
        ds["zero_stage"] = int(Prompt.ask("DeepSpeed: ZeRO stage?", choices=["1", "2", "3"],
                                          default="2"))
        ds["offload_optimizer_device"] = Prompt.ask(
            "DeepSpeed: offload optimizer state to?", choices=list(OFFLOAD), default="none")
        ds["offload_param_device"] = Prompt.ask(
            "DeepSpeed: offload parameters to?", choices=list(OFFLOAD), default="none") \
            if ds["zero_stage"] == 3 else "none"
    cfg["mixed_precision"] = Prompt.ask("Mixed precision?", choices=list(PRECISION_ENV),
                                        default="no")
    return validate_launch_config(cfg)


def write_config(cfg: dict, path: "str | Path") -> Path:
    import yaml
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in cfg.items()     # only the options of the chosen strategy
           if not (k.endswith("_config") and k != f"{cfg['strategy']}_config")}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def config_command(args: argparse.Namespace) -> int:
    path = Path(args.config_file) if args.config_file else default_config_path()
    if args.default:
        cfg = default_launch_config()
    else:
        try:
            cfg = wizard()
        except EOFError:
            raise UsageError("config: input ended before every question was answered")
        except KeyboardInterrupt:
            print()
            return 130
    write_config(cfg, path)
    print(f"ember: configuration saved at {path}")
    return 0


# --------------------------------------------------------------------------- env
OPTIONAL_PACKAGES = ("tensorboard", "wandb", "deepspeed", "transformers", "torchmetrics",
                     "rich", "safetensors", "pyyaml")


def _version(dist: str) -> str:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def env_report() -> str:
    import platform
    import torch
    import ember
    lines = [f"- `ember` version: {ember.__version__}",
             f"- Python version: {platform.python_version()} ({sys.implementation.name})",
             f"- Platform: {platform.platform()}",
             f"- PyTorch version: {torch.__version__}",
             f"- CUDA version (torch build): {torch.version.cuda or 'none'}",
             f"- cuDNN version: {torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else 'none'}",
             f"- CUDA available: {torch.cuda.is_available()}"]
    if torch.cuda.is_available():
        lines.append(f"- GPUs ({torch.cuda.device_count()}):")
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            lines.append(f"  - cuda:{i}: {props.name} ({props.total_memory / 2**30:.1f} GiB)")
    else:
        lines.append("- GPUs: none")
    mps = getattr(torch.backends, "mps", None)
    lines.append(f"- MPS available: {bool(mps and mps.is_available())}")
    lines.append(f"- CPU cores: {os.cpu_count()}")
    from ember.big_modeling import describe_device_map
    lines.append(f"- Big models: {describe_device_map()}")
    lines.append(f"- numpy version: {_version('numpy')}")
    for dist in OPTIONAL_PACKAGES:
        lines.append(f"- {dist} version: {_version(dist)}")
    path = default_config_path()
    if path.is_file():
        lines.append(f"- Default launch config ({path}):")
        lines.append("  ```yaml")
        lines += ["  " + line for line in path.read_text().rstrip().splitlines()]
        lines.append("  ```")
    else:
        lines.append(f"- Default launch config: none ({path} does not exist)")
    return "\n".join(lines)


def env_command(args: argparse.Namespace) -> int:
    print("Copy-and-paste the text below in your issue.\n")
    print(env_report())
    return 0
