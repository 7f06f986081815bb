"""`uccl-ep-megatron report`: PNG plots and the side-by-side table, from JSONL runs."""

from __future__ import annotations

import json
import struct

import pytest

from uccl_ep_megatron.cli import main
from uccl_ep_megatron.errors import InvalidInputError
from uccl_ep_megatron.metrics import MetricsLogger, expert_load_imbalance, read_jsonl
from uccl_ep_megatron.report import comparison_table, summarize

pytest.importorskip("matplotlib")


def _run(tmp_path, name: str, dispatcher: str, tok: float, steps: int = 6):
    run = tmp_path / name
    with MetricsLogger(
        run, {"recipe": "deepseek-v3/proxy", "dispatcher": dispatcher}, use_wandb=False
    ) as m:
        for step in range(1, steps + 1):
            # Warm-up steps are slow; the table must leave them out.
            scale = 0.1 if step <= 2 else 1.0
            m.log(
                step,
                {
                    "loss": 10.0 / step,
                    "tokens_per_s": tok * scale,
                    "tokens_per_s_per_gpu": tok * scale / 2,
                    "tflops_per_gpu": tok * scale * 1e-3,
                    "dispatch_time_ms": 2.0,
                    "combine_time_ms": 3.0,
                },
            )
    return run


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_report_two_runs(tmp_path, capsys):
    a = _run(tmp_path, "a2a", "alltoall", 1000.0)
    b = _run(tmp_path, "uccl", "uccl_ep", 1500.0)
    out = tmp_path / "rep"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for stem in ("loss", "tokens_per_s", "tflops_per_gpu", "dispatch_combine_time"):
        png = out / f"{stem}.png"
        assert png.stat().st_size > 1000
        w, h = _png_size(png)
        assert w > 100 and h > 100
    # Steady-state means skip the 2 warm-up steps: exactly 1000 and 1500, ratio 1.5.
    assert "| tokens/s | 1000.0 | 1500.0 | 1.500 |" in printed
    assert "| final loss | 1.6667 | 1.6667 | 1.000 |" in printed
    assert "alltoall" in printed and "uccl_ep" in printed
    assert (out / "report.md").read_text().strip() == comparison_table([a, b]).strip()


def test_summarize_and_imbalance():
    recs = [
        {"step": 1, "x": 100.0},
        {"step": 2, "x": 1.0},
        {"step": 3, "x": 3.0},
        {"step": 4, "loss": 2.0},
    ]
    s = summarize(recs, warmup_steps=1)
    assert s["x"] == 2.0 and s["loss"] == 2.0
    assert expert_load_imbalance([1, 1, 4, 2]) == 2.0
    assert expert_load_imbalance([0, 0]) == 0.0


def test_bad_run_dir(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err
    with pytest.raises(InvalidInputError, match="not a number"):
        with MetricsLogger(tmp_path / "r", {}, use_wandb=False) as m:
            m.log(1, {"loss": "high"})


def test_jsonl_roundtrip_keeps_non_finite_as_null(tmp_path):
    with MetricsLogger(tmp_path, {"k": 1}, use_wandb=False) as m:
        m.log(3, {"loss": float("nan"), "tokens_per_s": 5.0})
    (rec,) = read_jsonl(tmp_path)
    assert rec["step"] == 3 and rec["loss"] is None and rec["tokens_per_s"] == 5.0
    assert json.loads((tmp_path / "config.json").read_text()) == {"k": 1}
