"""The closing table of ``uccl-ep-megatron train`` and where runs go by default.

Shared by the job (``training.job``) and the GPU loop (``training.gpu.loop``), so neither
imports the other's module for it.
"""

from __future__ import annotations

import time
from pathlib import Path

from uccl_ep_megatron.core.errors import InvalidInputError


def default_run_dir(recipe_name: str, dispatcher: str, mode: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{recipe_name.replace('/', '-')}-{dispatcher}-{mode}-{stamp}"


def _dev_host(m: dict[str, float], kind: str) -> str:
    """``device / host`` ms of ``kind`` per step (``telemetry.dispatch``); ``-`` if not timed."""
    if f"{kind}_time_ms" not in m:
        return "-"
    host = m.get(f"{kind}_host_ms")
    host_text = f"{host:.2f}" if host is not None else "?"
    return f"{m[f'{kind}_time_ms']:.2f} / {host_text}"


_EXCHANGE = (
    "dispatch_time_ms",
    "combine_time_ms",
    "dispatch_backward_time_ms",
    "combine_backward_time_ms",
)


_PERMUTE = ("permute_time_ms", "permute_backward_time_ms")


def _exchange(m: dict[str, float]) -> str:
    """The step's exchange time, forward and backward dispatch and combine (``telemetry.dispatch``),
    ``+`` the dispatcher's permutation around it, forward and backward, where timed; in brackets
    the speed-up a dispatcher that cost nothing would give: step / (step - both); ``-`` when the
    backward was not timed."""
    if not all(k in m for k in _EXCHANGE):
        return "-"
    ex = sum(m[k] for k in _EXCHANGE)
    text = f"{ex:.2f}"
    if all(k in m for k in _PERMUTE):
        permute = sum(m[k] for k in _PERMUTE)
        text, ex = f"{text} + {permute:.2f}", ex + permute
    step_ms = 1e3 * m["step_time_s"]
    bound = f" ({step_ms / (step_ms - ex):.3f}x)" if step_ms > ex else ""
    return f"{text}{bound}"


def results_table(run_dirs: list[Path], warmup_steps: int = 3):
    """A ``rich`` table of finished runs: one row per run, steady-state means.

    Steps after the first ``warmup_steps`` (compilation, allocator growth) are averaged; loss is
    shown first -> last. With several runs, one row per later run gives the first run's
    throughput over that run's. ``exchange + permute ms fwd+bwd`` is the step's dispatch and
    combine, then the dispatcher's permutation around them, each forward and backward, and in
    brackets step / (step - both): what a dispatcher that cost nothing would make of this run's
    step.
    """
    import json

    from rich.table import Table

    from uccl_ep_megatron.telemetry.metrics import read_jsonl
    from uccl_ep_megatron.telemetry.report import summarize

    table = Table(title="uccl-ep-megatron train")
    for column in (
        "dispatcher",
        "mode",
        "FP8 dispatch",
        "experts",
        "GPUs",
        "tokens/s",
        "TFLOP/s/GPU",
        "MFU",
        "step (s)",
        "dispatch ms dev/host",
        "combine ms dev/host",
        "exchange + permute ms fwd+bwd",
        "loss first -> last",
    ):
        table.add_column(
            column, justify="left" if column in ("dispatcher", "mode", "experts") else "right"
        )
    means = []
    for run_dir in run_dirs:
        records = read_jsonl(run_dir)  # raises when the run left no metrics.jsonl
        if not records:
            raise InvalidInputError(f"{run_dir}: metrics.jsonl has no records (no step ran)")
        config = json.loads((Path(run_dir) / "config.json").read_text())
        m = summarize(records, min(warmup_steps, len(records) - 1))
        means.append(m)
        table.add_row(
            str(config.get("dispatcher", "?")),
            str(config.get("dispatch_mode", "?")),
            "yes" if config.get("fp8_dispatch") else "no",
            str(config.get("experts", "?")),
            str(config.get("world_size", "?")),
            f"{m['tokens_per_s']:,.0f}",
            f"{m['tflops_per_gpu']:.1f}",
            f"{100 * m['mfu']:.1f}%" if "mfu" in m else "n/a (unknown GPU: --peak-tflops)",
            f"{m['step_time_s']:.3f}",
            _dev_host(m, "dispatch"),
            _dev_host(m, "combine"),
            _exchange(m),
            f"{records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}",
        )
    a = means[0]
    for i, b in enumerate(means[1:], start=2):
        table.add_row(
            f"ratio (1st / {_ordinal(i)})",
            "",
            "",
            "",
            "",
            f"{a['tokens_per_s'] / b['tokens_per_s']:.3f}",
            f"{a['tflops_per_gpu'] / b['tflops_per_gpu']:.3f}",
            "",
            f"{a['step_time_s'] / b['step_time_s']:.3f}",
            "",
            "",
            "",
            "",
        )
    return table


def _ordinal(i: int) -> str:
    return {2: "2nd", 3: "3rd"}.get(i, f"{i}th")


def print_results(run_dirs: list[Path], warmup_steps: int = 3) -> None:
    """Print :func:`results_table` of ``run_dirs`` to stdout."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # a log file: no terminal width to fit, keep every column whole
        console = Console(width=220)
    console.print(results_table([Path(d) for d in run_dirs], warmup_steps))


__all__ = ["default_run_dir", "print_results", "results_table"]
