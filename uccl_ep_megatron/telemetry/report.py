"""Plots and comparison tables of training runs (``uccl-ep-megatron report``).

Reads ``RUN_DIR/metrics.jsonl`` (written by
:class:`uccl_ep_megatron.telemetry.metrics.MetricsLogger`), plots loss, tokens/s, TFLOP/s per
GPU and dispatch/combine time per step as PNGs, and, for two or more runs, prints a
side-by-side table of their steady-state means (the first ``warmup_steps`` steps are left out:
they include compilation and allocator growth). A loss that went NaN or infinite is shown, with
a warning under the table, never replaced by an earlier finite value.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from uccl_ep_megatron.core.errors import InvalidInputError, UnsupportedError
from uccl_ep_megatron.telemetry.metrics import JSONL_NAME, read_jsonl

#: (file stem, title, metric keys drawn on one axis, y label)
PLOTS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("loss", "Training loss", ("loss",), "loss"),
    ("tokens_per_s", "Throughput", ("tokens_per_s",), "tokens/s (global)"),
    ("tflops_per_gpu", "Model TFLOP/s per GPU", ("tflops_per_gpu",), "TFLOP/s"),
    (
        "dispatch_combine_time",
        "Dispatch / combine time per step",
        ("dispatch_time_ms", "combine_time_ms", "dispatch_host_ms", "combine_host_ms"),
        "ms (device: CUDA events; host: CPU wall inside the call)",
    ),
)

#: Metrics of the comparison table, in order (label, key, format).
TABLE_METRICS: tuple[tuple[str, str, str], ...] = (
    ("tokens/s", "tokens_per_s", "{:.1f}"),
    ("tokens/s/GPU", "tokens_per_s_per_gpu", "{:.1f}"),
    ("TFLOP/s/GPU", "tflops_per_gpu", "{:.2f}"),
    ("step time (s)", "step_time_s", "{:.4f}"),
    ("dispatch device (ms)", "dispatch_time_ms", "{:.3f}"),
    ("combine device (ms)", "combine_time_ms", "{:.3f}"),
    ("dispatch host (ms)", "dispatch_host_ms", "{:.3f}"),
    ("combine host (ms)", "combine_host_ms", "{:.3f}"),
    ("dispatch GB/s", "dispatch_gbps", "{:.2f}"),
    ("combine GB/s", "combine_gbps", "{:.2f}"),
    ("expert load max/mean (global, mean of layers)", "expert_load_imbalance", "{:.3f}"),
    ("expert load max/mean (local, worst layer)", "local_expert_load_imbalance", "{:.3f}"),
    ("proxy cmds/s", "proxy_cmds_per_s", "{:.0f}"),
    ("final loss", "loss", "{:.4f}"),
)


def run_label(run_dir: Path) -> str:
    """A run's label: ``config.json``'s dispatcher and recipe when present, else the dir name."""
    cfg_path = run_dir / "config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        parts = [str(cfg[k]) for k in ("dispatcher", "recipe") if cfg.get(k)]
        if parts:
            return f"{run_dir.name} ({', '.join(parts)})"
    return run_dir.name


def load_run(run_dir: Path) -> list[dict[str, Any]]:
    """The records of a run, checked: text, at least one record, each with an integer
    ``step`` and numbers (or null) as metric values.

    Raises:
        InvalidInputError: naming the file, the line and the value.
    """
    path = run_dir / JSONL_NAME
    try:
        records = read_jsonl(run_dir)
    except UnicodeDecodeError as exc:
        raise InvalidInputError(
            f"{path} is not a text file of JSON lines ({exc.reason} at byte {exc.start}); pass "
            "the run directory of a `uccl-ep-megatron train` run"
        ) from None
    if not records:
        raise InvalidInputError(
            f"{path} holds no records: the run logged no step yet; wait for its first step or "
            "pass another run directory"
        )
    for n, r in enumerate(records, 1):
        step = r.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise InvalidInputError(
                f'{path} record {n} has step={step!r}: every record needs an integer "step" '
                "(the file was not written by `uccl-ep-megatron train`)"
            )
        for key in _NUMERIC & r.keys():
            value = r[key]
            if value is not None and (
                not isinstance(value, (int, float)) or isinstance(value, bool)
            ):
                raise InvalidInputError(
                    f"{path} record {n} (step {step}): {key}={value!r} is not a number; the "
                    "file is damaged or was not written by `uccl-ep-megatron train`"
                )
    return records


# The metrics the report reads: a string there is a damaged file, not a label.
_NUMERIC = frozenset(k for _, _, keys, _ in PLOTS for k in keys) | frozenset(
    key for _, key, _ in TABLE_METRICS
)


def _loss(record: dict[str, Any]) -> float | None:
    """A record's loss; NaN where it was not finite (``MetricsLogger`` writes those as null),
    ``None`` without a loss."""
    if "loss" not in record:
        return None
    value = record["loss"]
    return float("nan") if value is None else float(value)


def nonfinite_loss(records: list[dict[str, Any]]) -> list[int]:
    """Steps whose loss is NaN or infinite (a diverged run)."""
    return [r["step"] for r in records if (v := _loss(r)) is not None and not math.isfinite(v)]


def _finite(values: list[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def summarize(records: list[dict[str, Any]], warmup_steps: int = 2) -> dict[str, float]:
    """Mean of every metric over the steps after ``warmup_steps`` (``loss``: the last value,
    NaN or infinite included: a diverged run must show it).

    With fewer records than ``warmup_steps + 1`` all records are used.
    """
    steady = records[warmup_steps:] if len(records) > warmup_steps else records
    out: dict[str, float] = {}
    keys = {k for r in records for k in r} - {"step", "time"}
    for key in keys:
        if key == "loss":
            vals = [v for v in map(_loss, records) if v is not None]
            if vals:
                out[key] = vals[-1]
            continue
        vals = _finite([r.get(key) for r in steady])
        if vals:
            out[key] = sum(vals) / len(vals)
    return out


def comparison_table(run_dirs: list[Path], warmup_steps: int = 2) -> str:
    """A Markdown table of the runs' steady-state means side by side.

    With exactly two runs a last column gives the ratio second / first.
    """
    _check_warmup(warmup_steps)
    runs = [load_run(d) for d in run_dirs]
    summaries = [summarize(r, warmup_steps) for r in runs]
    labels = [run_label(d) for d in run_dirs]
    header = ["metric", *labels]
    if len(run_dirs) == 2:
        header.append("ratio (2nd/1st)")
    rows = [header, ["---"] * len(header)]
    for label, key, fmt in TABLE_METRICS:
        values = [s.get(key) for s in summaries]
        if all(v is None for v in values):
            continue
        row = [label] + ["-" if v is None else fmt.format(v) for v in values]
        if len(run_dirs) == 2:
            a, b = values
            row.append(f"{b / a:.3f}" if a and b is not None else "-")
        rows.append(row)
    table = "\n".join("| " + " | ".join(r) + " |" for r in rows)
    return "\n".join([table, *divergence_notes(run_dirs, runs)])


def divergence_notes(run_dirs: list[Path], runs: list[list[dict[str, Any]]]) -> list[str]:
    """One line per run whose loss went NaN or infinite: the table and plots show it, but a
    reader must not miss it."""
    notes = []
    for d, records in zip(run_dirs, runs, strict=True):
        bad = nonfinite_loss(records)
        if bad:
            with_loss = sum(1 for r in records if _loss(r) is not None)
            notes.append(
                f"\nWARNING: {run_label(d)}: the loss is NaN or infinite at {len(bad)} of "
                f"{with_loss} steps (first at step {bad[0]}): the run diverged"
                + ("; the loss plot is empty" if len(bad) == with_loss else "")
            )
    return notes


def _check_warmup(warmup_steps: Any) -> None:
    if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
        raise InvalidInputError(
            f"--warmup-steps {warmup_steps!r}: give the number of first steps to leave out of "
            "the means, 0 or more"
        )


def plot_runs(run_dirs: list[Path], out_dir: Path) -> list[Path]:
    """Draw :data:`PLOTS` for all runs (one line per run and metric) into ``out_dir``.

    Returns:
        The PNG paths written (a plot is skipped when no run has its metrics).

    Raises:
        UnsupportedError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise UnsupportedError(
            "report needs matplotlib for the PNG plots: pip install matplotlib "
            "(or pip install 'uccl-ep-megatron[megatron]')"
        ) from exc
    _make_out_dir(out_dir)
    runs = [(run_label(d), load_run(d)) for d in run_dirs]
    written: list[Path] = []
    for stem, title, keys, ylabel in PLOTS:
        fig, ax = plt.subplots(figsize=(7, 4))
        drawn = 0
        for label, records in runs:
            for key in keys:
                pts = [
                    (r["step"], r[key])
                    for r in records
                    if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
                ]
                if not pts:
                    continue
                xs, ys = zip(*pts, strict=True)
                name = label if len(keys) == 1 else f"{label}: {key.removesuffix('_time_ms')}"
                ax.plot(xs, ys, marker="o", markersize=3, label=name)
                drawn += 1
        if drawn:
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            path = out_dir / f"{stem}.png"
            fig.savefig(path, dpi=100)
            written.append(path)
        plt.close(fig)
    return written


def _make_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise InvalidInputError(
            f"--out {out} is a file; give a directory for the PNGs and report.md"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidInputError(f"--out {out}: cannot create it ({exc.strerror})") from None


def report(run_dirs: list[str | Path], out_dir: str | Path | None = None, warmup_steps: int = 2):
    """Plots for ``run_dirs`` and (two or more runs) the comparison table.

    Args:
        run_dirs: one or more run directories (each with ``metrics.jsonl``).
        out_dir: where PNGs and ``report.md`` go (default: the first run's ``report/``).
        warmup_steps: steps left out of the table's means.

    Returns:
        ``(png_paths, table_markdown)``.

    Raises:
        InvalidInputError: no run given, a run directory without a readable ``metrics.jsonl``
            (see ``load_run``), a negative ``warmup_steps``, or an ``out_dir`` that is a file.
    """
    dirs = [Path(d) for d in run_dirs]
    if not dirs:
        raise InvalidInputError("report needs at least one RUN_DIR")
    _check_warmup(warmup_steps)
    for d in dirs:
        load_run(d)  # raises a clear error for a wrong directory before anything is drawn
    out = Path(out_dir) if out_dir else dirs[0] / "report"
    _make_out_dir(out)
    pngs = plot_runs(dirs, out)
    table = comparison_table(dirs, warmup_steps)
    (out / "report.md").write_text(table + "\n")
    return pngs, table


__all__ = [
    "PLOTS",
    "TABLE_METRICS",
    "comparison_table",
    "load_run",
    "nonfinite_loss",
    "plot_runs",
    "report",
    "summarize",
]
