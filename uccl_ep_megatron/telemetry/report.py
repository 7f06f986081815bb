"""Plots and comparison tables of training runs (``uccl-ep-megatron report``).

Reads ``RUN_DIR/metrics.jsonl`` (written by :class:`uccl_ep_megatron.telemetry.metrics.MetricsLogger`),
plots loss, tokens/s, TFLOP/s per GPU and dispatch/combine time per step as PNGs, and, for two
or more runs, prints a side-by-side table of their steady-state means (the first
``warmup_steps`` steps are left out: they include compilation and allocator growth).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from uccl_ep_megatron.core.errors import InvalidInputError, UnsupportedError
from uccl_ep_megatron.telemetry.metrics import read_jsonl

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


def _finite(values: list[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def summarize(records: list[dict[str, Any]], warmup_steps: int = 2) -> dict[str, float]:
    """Mean of every metric over the steps after ``warmup_steps`` (``loss``: the last value).

    With fewer records than ``warmup_steps + 1`` all records are used.
    """
    steady = records[warmup_steps:] if len(records) > warmup_steps else records
    out: dict[str, float] = {}
    keys = {k for r in records for k in r} - {"step", "time"}
    for key in keys:
        if key == "loss":
            vals = _finite([r.get(key) for r in records])
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
    summaries = [summarize(read_jsonl(d), warmup_steps) for d in run_dirs]
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
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


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
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = [(run_label(d), read_jsonl(d)) for d in run_dirs]
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


def report(run_dirs: list[str | Path], out_dir: str | Path | None = None, warmup_steps: int = 2):
    """Plots for ``run_dirs`` and (two or more runs) the comparison table.

    Args:
        run_dirs: one or more run directories (each with ``metrics.jsonl``).
        out_dir: where PNGs and ``report.md`` go (default: the first run's ``report/``).
        warmup_steps: steps left out of the table's means.

    Returns:
        ``(png_paths, table_markdown)``.

    Raises:
        InvalidInputError: no run given, or a run directory without ``metrics.jsonl``.
    """
    dirs = [Path(d) for d in run_dirs]
    if not dirs:
        raise InvalidInputError("report needs at least one RUN_DIR")
    for d in dirs:
        read_jsonl(d)  # raises a clear error for a wrong directory before anything is drawn
    out = Path(out_dir) if out_dir else dirs[0] / "report"
    pngs = plot_runs(dirs, out)
    table = comparison_table(dirs, warmup_steps)
    (out / "report.md").write_text(table + "\n")
    return pngs, table


__all__ = ["PLOTS", "TABLE_METRICS", "comparison_table", "plot_runs", "report", "summarize"]
