"""The run report: one self-contained HTML page per run (or several runs overlaid).

    ember report LOG_DIR [--out report.html]      # one run
    ember report RUN_A RUN_B ... --out cmp.html   # several runs on the same charts
    Trainer(report=True)                          # written at the end of fit

It reads what the run wrote: the CSV logger's ``metrics.csv`` or TensorBoard event
files (through TensorBoard's own ``EventAccumulator``), ``hparams.yaml``,
``config.yaml`` (the CLI's resolved config), ``run.json`` (start/end time, stop
reason, best checkpoint; written by every ``fit``) and the simple profiler's table.
Every scalar becomes a curve over the global step; names that differ only by a
split prefix (``train/loss`` and ``val/loss``, ``train_acc`` and ``val_acc``) share
one chart; dotted lines mark epoch ends. Charts are drawn with matplotlib (the
``report`` extra: ``pip install 'ember[report]'``), embedded as base64 PNG (the
page needs no network) and also written as PNG files next to the page.
"""
from __future__ import annotations

import base64
import csv
import glob
import html
import io
import json
import os
import re
from dataclasses import dataclass, field

from ember.errors import MisconfigurationError

_SPLITS = ("train", "training", "val", "valid", "validation", "test")
_SKIP = {"step", "epoch"}
_EVENTS = "events.out.tfevents.*"


@dataclass
class RunData:
    """What one run's folder holds."""
    path: str
    name: str
    source: str = ""
    scalars: dict = field(default_factory=dict)   # name -> ([steps], [values])
    hparams: dict = field(default_factory=dict)
    config: str = ""
    info: dict = field(default_factory=dict)
    profile: str = ""
    notes: list = field(default_factory=list)   # files of the folder left out, and why

    def epoch_ends(self) -> list[int]:
        """Steps at which an epoch ended (from ``run.json`` or the logged ``epoch`` values)."""
        ends = self.info.get("epoch_end_steps")
        if ends and isinstance(ends, list) and all(isinstance(s, (int, float)) for s in ends):
            return [int(s) for s in ends]
        steps, vals = self.scalars.get("epoch", ([], []))
        ends, prev = [], None
        for s, v in sorted(zip(steps, vals)):
            if prev is not None and v > prev[1]:
                ends.append(prev[0])
            prev = (s, v)
        return ends


def _has_logs(d: str) -> bool:
    return os.path.isfile(os.path.join(d, "metrics.csv")) or bool(glob.glob(os.path.join(d, _EVENTS)))


def find_run_dir(path: str) -> str:
    """``path`` itself when it holds logs, else its newest sub-folder that does."""
    path = os.fspath(path)
    if os.path.isfile(path):
        path = os.path.dirname(path) or "."
    if not os.path.isdir(path):
        raise MisconfigurationError(f"ember report: {path!r} is not a folder")
    if _has_logs(path):
        return path
    found = [d for d, _, _ in os.walk(path) if _has_logs(d) and "plugins" not in d.split(os.sep)]
    if not found:
        raise MisconfigurationError(f"ember report: no metrics.csv or TensorBoard event files under {path!r}; "
                                    "pass a run's log folder (trainer.log_dir)")
    return max(found, key=os.path.getmtime)


def _read_csv(path: str) -> dict:
    out: dict = {}
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            step = row.get("step")
            if step in (None, ""):
                continue
            for k, v in row.items():
                if k == "step" or v in (None, ""):
                    continue
                try:
                    val = float(v)
                except ValueError:
                    continue
                s, vs = out.setdefault(k, ([], []))
                s.append(int(float(step)))
                vs.append(val)
    return out


def _read_events(path: str) -> dict:
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():   # a first import leaves the user's random streams as they were
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(path, size_guidance={"scalars": 0})
    ea.Reload()
    out = {}
    for tag in ea.Tags().get("scalars", []):
        ev = ea.Scalars(tag)
        out[tag] = ([e.step for e in ev], [float(e.value) for e in ev])
    return out


def load_run(path: str) -> RunData:
    """Read one run's folder (see the module docstring for the files it uses)."""
    d = find_run_dir(path)
    parts = os.path.normpath(os.path.abspath(d)).split(os.sep)
    run = RunData(path=d, name="/".join(parts[-2:]))
    if os.path.isfile(os.path.join(d, "metrics.csv")):
        run.source, run.scalars = "metrics.csv", _read_csv(os.path.join(d, "metrics.csv"))
    else:
        run.source, run.scalars = "TensorBoard events", _read_events(d)
    hp = os.path.join(d, "hparams.yaml")
    if os.path.isfile(hp):
        run.hparams = _read_mapping(run, hp, _load_yaml_file)
    for name, attr in (("config.yaml", "config"), ("profile-simple-rank0.txt", "profile")):
        p = os.path.join(d, name)
        if os.path.isfile(p):
            with open(p, encoding="utf-8") as f:
                setattr(run, attr, f.read())
    rj = os.path.join(d, "run.json")
    if os.path.isfile(rj):
        run.info = _read_mapping(run, rj, _load_json_file)
    return run


#: a run folder's hparams.yaml or run.json larger than this is skipped, unread
MAX_RUN_FILE_BYTES = 16 * 2**20


def _load_yaml_file(path: str):
    from ember.checkpoint.trust import load_yaml   # (its first import of yaml keeps the random streams)
    with open(path, encoding="utf-8") as f:
        return load_yaml(f.read(MAX_RUN_FILE_BYTES + 1))


def _load_json_file(path: str):
    from ember.checkpoint.trust import MAX_YAML_DEPTH
    with open(path, encoding="utf-8") as f:
        text = f.read(MAX_RUN_FILE_BYTES + 1)
    depth = deepest = 0
    for ch in re.sub(r'"(?:\\.|[^"\\])*"', "", text):    # the nesting, before it is parsed
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    if deepest > MAX_YAML_DEPTH:
        raise ValueError(f"it nests deeper than {MAX_YAML_DEPTH} levels")
    return json.loads(text)


def _read_mapping(run: RunData, path: str, load) -> dict:
    """A run folder's ``hparams.yaml`` / ``run.json`` as a mapping. A file that cannot be
    read (too large, too deep, aliases past ember's bound, not a mapping, corrupt) is left
    out with a note (a warning, and a line on the page): the report is drawn without it."""
    import warnings
    why = None
    try:
        if os.path.getsize(path) > MAX_RUN_FILE_BYTES:
            why = f"it is larger than {MAX_RUN_FILE_BYTES} bytes"
        else:
            data = load(path)
            if data is None:
                return {}
            if isinstance(data, dict):
                return data
            why = f"it holds a {type(data).__name__}, not a mapping"
    except Exception as err:   # noqa: BLE001 - a bad file of a downloaded run never stops the report
        why = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
    note = f"{os.path.basename(path)} is left out: {why}"
    run.notes.append(note)
    warnings.warn(f"run report: {path} is left out: {why}", UserWarning, stacklevel=3)
    return {}


def chart_key(name: str) -> str:
    """The chart a scalar goes on: its name without a train/val/test prefix or suffix
    and without Lightning-style ``_step`` / ``_epoch`` suffixes."""
    n = re.sub(r"_(step|epoch)$", "", name)
    for sep in ("/", "_", "-", "."):
        if sep in n:
            head, tail = n.split(sep, 1)
            if head.lower() in _SPLITS and tail:
                return tail
            head, tail = n.rsplit(sep, 1)
            if tail.lower() in _SPLITS and head:
                return head
    return n


def group_charts(runs: list[RunData]) -> dict[str, list[str]]:
    """chart key -> scalar names (in order of first appearance over the runs)."""
    charts: dict[str, list[str]] = {}
    for run in runs:
        for name in run.scalars:
            if name in _SKIP:
                continue
            names = charts.setdefault(chart_key(name), [])
            if name not in names:
                names.append(name)
    return {k: sorted(v, key=_split_rank) for k, v in charts.items()}   # train, val, test, others


def _slug(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key).strip("_") or "chart"


_STYLES = ("-", "--", ":", "-.")


def _split_rank(name: str) -> int:
    low = name.lower()
    for i, prefixes in enumerate((("train", "training"), ("val", "valid", "validation"), ("test",))):
        if any(re.search(rf"(^|[/_.-]){p}([/_.-]|$)", low) for p in prefixes):
            return i
    return 3


def _plot(key: str, names: list[str], runs: list[RunData]) -> bytes:
    """One chart. One run: a color per series. Several runs: a color per run, a line
    style per series (train solid, val dashed...). Dotted lines: epoch ends of the runs shown."""
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():   # a first import leaves the user's random streams as they were
        import matplotlib
    matplotlib.use("Agg", force=False)
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():   # a first import leaves the user's random streams as they were
        import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    try:
        multi = len(runs) > 1
        shown = []
        for r, run in enumerate(runs):
            present = [n for n in names if n in run.scalars]
            if present:
                shown.append((r, run))
            for j, name in enumerate(present):
                steps, vals = run.scalars[name]
                kw = dict(color=f"C{r % 10}", linestyle=_STYLES[j % len(_STYLES)]) if multi else {}
                ax.plot(steps, vals, marker="o" if len(steps) <= 40 else None, markersize=3, linewidth=1.4,
                        label=f"{run.name}: {name}" if multi else name, **kw)
        labelled = False
        for r, run in shown:
            ends = run.epoch_ends()
            stride = max(1, len(ends) // 30)
            for s in ends[::stride]:
                ax.axvline(s, color=f"C{r % 10}" if multi else "0.45", alpha=0.5 if multi else 1.0,
                           linestyle=(0, (2, 3)), linewidth=0.9, label=None if labelled else "epoch end")
                labelled = True
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # a first import leaves the user's random streams as they were
            from matplotlib.text import Text
        for text in fig.findobj(Text):    # metric names as written: "$...$" is not math text here
            text.set_parse_math(False)
            text.set_usetex(False)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()
    finally:
        plt.close(fig)


def _flatten(d, prefix="") -> dict:
    out = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


_INFO_ROWS = (("start_time", "start"), ("end_time", "end"), ("duration_s", "duration (s)"), ("status", "status"),
              ("stop_reason", "stop reason"), ("global_step", "global steps"), ("epochs_completed", "epochs"),
              ("best_model_path", "best checkpoint"), ("best_model_score", "best score"), ("monitor", "monitor"),
              ("last_model_path", "last checkpoint"), ("module", "module"), ("strategy", "strategy"),
              ("world_size", "processes"), ("precision", "precision"), ("error", "error"))

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1400px;
 padding:0 16px;color:#222;background:#fafafa}
h1{font-size:22px;margin-bottom:4px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd;padding-bottom:4px}
.sub{color:#666;font-size:13px}
table{border-collapse:collapse;font-size:13px;background:#fff}
td,th{border:1px solid #e3e3e3;padding:4px 10px;text-align:left;vertical-align:top}
th{background:#f0f0f0;font-weight:600}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:14px}
figure{margin:0;background:#fff;border:1px solid #e3e3e3;border-radius:6px;padding:8px}
figure img{width:100%;height:auto;display:block}
figcaption{font-size:12px;color:#555;margin-top:4px;word-break:break-all}
pre{background:#fff;border:1px solid #e3e3e3;padding:10px;font-size:12px;overflow:auto;max-height:480px}
.ok{color:#1a7f37;font-weight:600}.bad{color:#c62828;font-weight:600}
"""


def _e(v) -> str:
    return html.escape("" if v is None else str(v))


def _info_table(runs: list[RunData]) -> str:
    head = "<tr><th></th>" + "".join(f"<th>{_e(r.name)}</th>" for r in runs) + "</tr>"
    rows = [f"<tr><th>log folder</th>{''.join(f'<td>{_e(r.path)}</td>' for r in runs)}</tr>",
            f"<tr><th>read from</th>{''.join(f'<td>{_e(r.source)}</td>' for r in runs)}</tr>"]
    for key, label in _INFO_ROWS:
        if not any(r.info.get(key) not in (None, "") for r in runs):
            continue
        cells = []
        for r in runs:
            v = r.info.get(key)
            cls = ' class="ok"' if key == "status" and v == "success" else \
                ' class="bad"' if key == "status" and v else ""
            cells.append(f"<td{cls}>{_e(v)}</td>")
        rows.append(f"<tr><th>{_e(label)}</th>{''.join(cells)}</tr>")
    if any(r.notes for r in runs):
        rows.append(f"<tr><th>notes</th>{''.join(f'<td>{_e(chr(10).join(r.notes))}</td>' for r in runs)}</tr>")
    if not any(r.info for r in runs):
        rows.append('<tr><th>run facts</th><td colspan="99">no run.json in the folder (written by '
                    'Trainer.fit at its end)</td></tr>')
    return f"<table>{head if len(runs) > 1 else ''}{''.join(rows)}</table>"


def _hparams_table(runs: list[RunData]) -> str:
    flat = [_flatten(r.hparams) for r in runs]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    if not keys:
        return "<p class='sub'>none logged</p>"
    head = "<tr><th>name</th>" + ("".join(f"<th>{_e(r.name)}</th>" for r in runs) if len(runs) > 1
                                  else "<th>value</th>") + "</tr>"
    body = "".join(f"<tr><td>{_e(k)}</td>{''.join(f'<td>{_e(f.get(k))}</td>' for f in flat)}</tr>" for k in keys)
    return f"<table>{head}{body}</table>"


def render_html(runs: list[RunData], charts: dict[str, list[str]], pngs: dict[str, bytes], png_names: dict) -> str:
    """The page (a string); ``pngs`` maps chart key -> PNG bytes."""
    title = "ember run report: " + ", ".join(r.name for r in runs)
    figs = []
    for key, names in charts.items():
        b64 = base64.b64encode(pngs[key]).decode("ascii")
        figs.append(f'<figure data-chart="{_e(key)}" data-series="{_e(" ".join(names))}">'
                    f'<img alt="{_e(key)}: {_e(", ".join(names))}" src="data:image/png;base64,{b64}">'
                    f'<figcaption>{_e(", ".join(names))} &middot; {_e(png_names[key])}</figcaption></figure>')
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title>"
             f"<meta name='viewport' content='width=device-width, initial-scale=1'><style>{_CSS}</style></head><body>",
             f"<h1>{_e(title)}</h1><div class='sub'>{len(charts)} charts, "
             f"{sum(len([n for n in r.scalars if n not in _SKIP]) for r in runs)} logged scalar series; x axis: global step</div>",
             "<h2>Run</h2>", _info_table(runs),
             "<h2>Metrics</h2>", f"<div class='grid'>{''.join(figs)}</div>" if figs else "<p>no scalars logged</p>",
             "<h2>Hyperparameters</h2>", _hparams_table(runs)]
    for r in runs:
        if r.config:
            parts += [f"<h2>Config{_e(' of ' + r.name) if len(runs) > 1 else ''}</h2>", f"<pre>{_e(r.config)}</pre>"]
    for r in runs:
        if r.profile:
            parts += [f"<h2>Profile{_e(' of ' + r.name) if len(runs) > 1 else ''}</h2>", f"<pre>{_e(r.profile)}</pre>"]
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(paths: list[str], out: str | None = None, overwrite: bool = False) -> str:
    """Render the report of the runs in ``paths`` (log folders) to ``out`` (default:
    ``report.html`` in the run's folder for one run, in the current folder for
    several) plus ``<out stem>_charts/<chart>.png``. Returns the page's path.

    ``out`` follows ``ember predict --output``'s rules (checked before anything is drawn):
    not a folder, nothing inside an ember checkpoint, and an existing file is replaced
    only when it is a report ember wrote, or with ``overwrite``; the charts folder holds
    only PNG files. MisconfigurationError naming ``--out`` otherwise."""
    try:
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # a first import leaves the user's random streams as they were
            import matplotlib  # noqa: F401
    except ImportError:
        raise MisconfigurationError("the run report draws its charts with matplotlib: "
                                    "pip install 'ember[report]' (or pip install matplotlib)") from None
    if not paths:
        raise MisconfigurationError("ember report: give at least one log folder")
    runs = [load_run(p) for p in paths]
    if len(runs) > 1:
        seen: dict = {}
        for r in runs:   # distinct labels when two runs share a folder name
            seen[r.name] = seen.get(r.name, 0) + 1
            if seen[r.name] > 1:
                r.name = f"{r.name} ({seen[r.name]})"
    if out is None:
        out = os.path.join(runs[0].path, "report.html") if len(runs) == 1 else "report.html"
    out = os.fspath(out)
    png_dir = os.path.splitext(out)[0] + "_charts"
    _check_out(out, png_dir, overwrite)
    charts = group_charts(runs)
    os.makedirs(png_dir, exist_ok=True)
    pngs, names = {}, {}
    for key in list(charts):
        try:
            pngs[key] = _plot(key, charts[key], runs)
        except Exception as err:   # noqa: BLE001 - one chart that cannot be drawn never fails the run
            import warnings
            warnings.warn(f"run report: the chart {key!r} ({', '.join(charts[key])}) could not be drawn and is left "
                          f"out ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})",
                          UserWarning, stacklevel=2)
            del charts[key]
            continue
        fname = _slug(key) + ".png"
        while fname in names.values():
            fname = "_" + fname
        names[key] = fname
        with open(os.path.join(png_dir, fname), "wb") as f:
            f.write(pngs[key])
    page = render_html(runs, charts, pngs, {k: os.path.basename(png_dir) + "/" + v for k, v in names.items()})
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    from ember.checkpoint.io import replace_file

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(page)
    replace_file(out, write)     # a temporary name of its own: never a file of the user's
    return out


_PAGE_START = "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>ember run report: "


def _is_report(path: str) -> bool:
    """Whether ``path`` is a regular file that starts as every page ember writes does."""
    try:
        if os.path.islink(path) or not os.path.isfile(path):
            return False
        with open(path, "rb") as f:
            return f.read(len(_PAGE_START)).decode("utf-8", "replace") == _PAGE_START
    except OSError:
        return False


def _check_out(out: str, png_dir: str, overwrite: bool) -> None:
    """``--out`` and the charts folder, checked as :func:`write_report` says."""
    from ember.checkpoint.trust import check_output_path
    from ember.checkpoint.trust import checkpoint_containing
    if os.path.lexists(out) and not os.path.isdir(out) and not overwrite and not _is_report(out):
        raise MisconfigurationError(f"--out {out!r} exists and is not a report ember wrote; refusing to "
                                    "overwrite it. Choose another path, or pass --overwrite")
    check_output_path(out, True, (), "--out")
    if os.path.lexists(png_dir):
        others = (sorted(n for n in os.listdir(png_dir) if not n.endswith(".png"))
                  if os.path.isdir(png_dir) and not os.path.islink(png_dir) else None)
        if others is None or others:
            raise MisconfigurationError(
                f"--out {out!r}: its charts go to {png_dir}, which "
                + ("is not a folder" if others is None else f"holds other files ({others[:5]})")
                + "; refusing to write into it. Choose another --out")
        if checkpoint_containing(png_dir):
            raise MisconfigurationError(f"--out {out!r}: its charts folder {png_dir} lies inside the checkpoint "
                                        f"{checkpoint_containing(png_dir)}. Choose a path outside it")


# --------------------------------------------------------------------------- CLI
def add_subcommand(sub, fmt) -> None:
    """``ember report``'s argument parser."""
    sp = sub.add_parser("report", help="write an HTML report (curves, hparams, run facts) of one or more runs",
                        formatter_class=fmt, description=__doc__.split("\n\n")[0])
    sp.add_argument("runs", nargs="+", metavar="LOG_DIR", help="a run's log folder (several: overlaid)")
    sp.add_argument("--out", "-o", default=None, metavar="FILE",
                    help="the HTML file (default: LOG_DIR/report.html; report.html for several runs); an "
                         "existing file is replaced only when it is a report ember wrote, or with --overwrite")
    sp.add_argument("--overwrite", action="store_true",
                    help="replace the --out file if it exists (never a file inside a checkpoint)")


def report_command(args) -> int:
    from ember.errors import UsageError
    try:
        path = write_report(args.runs, args.out, overwrite=args.overwrite)
    except MisconfigurationError as err:
        raise UsageError(str(err)) from None
    print(path)
    return 0
