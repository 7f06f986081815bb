"""Throughput metrics: JSONL in the run directory always, wandb when it is installed.

wandb runs **offline** by default (files under ``RUN_DIR/wandb``, upload later with
``wandb sync``); **online** when ``WANDB_API_KEY`` is set or a project is passed explicitly
(``--wandb-project``). ``WANDB_MODE`` set by the user wins over both. ``metrics.jsonl`` in the
run directory holds the same records, one JSON object per step, so ``uccl-ep-megatron report``
and scripts need no wandb.

Metric names (all optional per record; ``step`` always present):

==============================  =============================================================
``loss``, ``lr``                training loss and learning rate
``step_time_s``                 wall time of the step
``tokens_per_s``                global tokens per second
``tokens_per_s_per_gpu``        ``tokens_per_s / world_size``
``tflops_per_gpu``              model TFLOP/s per GPU (``uccl_ep_megatron.telemetry.flops``)
``dispatch_time_ms``            device time of token dispatch per step, summed over MoE layers
                                (forward): CUDA events on the caller's stream around the
                                dispatcher's ``token_dispatch`` (``telemetry.dispatch``)
``combine_time_ms``             same for ``token_combine``
``dispatch_host_ms``            host (CPU wall) time inside the same ``token_dispatch`` calls;
                                a host sync inside a call counts here and in the device time
``combine_host_ms``             same for ``token_combine``
``dispatch_backward_time_ms``   device time of the dispatches' backward per step (calls timed by
                                ``telemetry.dispatch.instrument`` whose rows need a gradient)
``combine_backward_time_ms``    same for the combines' backward
``permute_time_ms``             device time of the dispatcher's methods around the exchange
                                per step (megatron-core's ``dispatch_preprocess``,
                                ``dispatch_postprocess``, ``combine_preprocess``,
                                ``combine_postprocess``; calls timed by ``instrument``)
``permute_backward_time_ms``    same for their backward
``dispatch_gbps``               bytes of received token rows / dispatch time (DeepEP metric)
``combine_gbps``                the same bytes / combine time
``expert_load_imbalance``       max / mean tokens per expert over every expert of the model
                                (all ranks), averaged over MoE layers; 1.0 = balanced
``local_expert_load_imbalance`` the worst MoE layer's max / mean over one rank's local experts
                                (``telemetry.dispatch``; not comparable with the one above)
``proxy_cmds_per_s``            proxy commands per second, when the backend reports them
==============================  =============================================================
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from uccl_ep_megatron.core.errors import InvalidInputError

log = logging.getLogger(__name__)

JSONL_NAME = "metrics.jsonl"


def expert_load_imbalance(tokens_per_expert: Iterable[float]) -> float:
    """max / mean of tokens per expert; 1.0 when balanced, 0.0 when no token was routed."""
    counts = [float(c) for c in tokens_per_expert]
    if not counts:
        raise InvalidInputError("tokens_per_expert is empty; pass one count per expert")
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean > 0 else 0.0


def bandwidth_gbps(num_bytes: float, seconds: float) -> float:
    """GB/s (1e9 bytes per second); 0.0 for a zero duration."""
    return num_bytes / seconds / 1e9 if seconds > 0 else 0.0


def wandb_mode(project_given: bool) -> str:
    """The wandb mode this process uses: ``WANDB_MODE``, else online/offline (module doc)."""
    env = os.environ.get("WANDB_MODE")
    if env:
        return env
    return "online" if (os.environ.get("WANDB_API_KEY") or project_given) else "offline"


class MetricsLogger:
    """Writes one record per step to ``RUN_DIR/metrics.jsonl`` and (if installed) to wandb.

    Only the process constructed with ``enabled=True`` (rank 0) writes; the others keep the
    same interface and do nothing, so callers need no rank checks.

    Args:
        run_dir: directory of the run (created).
        config: run configuration (recipe, world size, dispatcher), saved to ``config.json``
            and to the wandb run's config.
        project: wandb project; ``None`` = ``uccl-ep-megatron`` in offline mode.
        name: wandb run name (default: the run directory's name).
        use_wandb: ``False`` keeps wandb out even when it is installed.
        enabled: ``False`` on every rank but one.
    """

    def __init__(
        self,
        run_dir: str | Path,
        config: Mapping[str, Any],
        project: str | None = None,
        name: str | None = None,
        use_wandb: bool = True,
        enabled: bool = True,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.wandb_run = None
        self.wandb_dir: Path | None = None
        self._jsonl = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(dict(config), indent=2, default=str))
        self._jsonl = open(self.run_dir / JSONL_NAME, "a", buffering=1)  # noqa: SIM115
        if use_wandb:
            self._start_wandb(config, project, name)

    def _start_wandb(
        self, config: Mapping[str, Any], project: str | None, name: str | None
    ) -> None:
        try:
            import wandb
        except ImportError:
            log.info("wandb is not installed; metrics go to %s only", self.run_dir / JSONL_NAME)
            return
        mode = wandb_mode(project is not None)
        self.wandb_run = wandb.init(
            project=project or "uccl-ep-megatron",
            name=name or self.run_dir.name,
            dir=str(self.run_dir),
            config=dict(config),
            mode=mode,
            reinit="finish_previous",
        )
        self.wandb_dir = Path(self.wandb_run.dir).parent if mode != "disabled" else None
        log.info("wandb run %s (%s) in %s", self.wandb_run.id, mode, self.wandb_dir)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` of ``step`` (numbers; non-finite values are kept as JSON null)."""
        if not self.enabled:
            return
        record = {"step": int(step), "time": time.time()}
        for key, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidInputError(f"metric {key!r} = {value!r} is not a number")
            record[key] = value if value == value and abs(value) != float("inf") else None
        self._jsonl.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=int(step))

    def summary(self, values: Mapping[str, Any]) -> None:
        """Write run-level results (``summary.json``; wandb run summary)."""
        if not self.enabled:
            return
        (self.run_dir / "summary.json").write_text(json.dumps(dict(values), indent=2, default=str))
        if self.wandb_run is not None:
            for key, value in values.items():
                self.wandb_run.summary[key] = value

    def close(self) -> None:
        """Flush and finish (wandb offline files are complete after this)."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/metrics.jsonl`` in order.

    A last line cut short (what a killed run leaves) is dropped with a warning.

    Raises:
        InvalidInputError: the run directory has no ``metrics.jsonl``, or a line before the
            last is not a JSON object.
    """
    path = Path(run_dir) / JSONL_NAME
    if not path.is_file():
        raise InvalidInputError(
            f"{path} does not exist: pass the run directory of a `uccl-ep-megatron train` run"
        )
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    records = []
    for i, (n, line) in enumerate(lines):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(f"a {type(record).__name__}, not an object")
        except ValueError as exc:
            if i == len(lines) - 1:
                log.warning("%s: ignoring its last line %d, cut short (%s)", path, n, exc)
                break
            raise InvalidInputError(
                f"{path} line {n} is not a JSON object ({exc}); the file is damaged"
            ) from exc
        records.append(record)
    return records


# wandb's transaction log (``run-*.wandb``) uses LevelDB's log framing: a 7-byte file header
# (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of records, each with a 7-byte header
# (CRC-32 over type byte + payload, little-endian length, type FULL/FIRST/MIDDLE/LAST) and a
# protobuf ``Record`` as payload. Reading it back checks what wandb really stored.
_WB_HEADER = b":W&B\xe1\xbe\x00"
_WB_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _wandb_records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    if not data.startswith(_WB_HEADER):
        raise InvalidInputError(f"{path} is not a wandb transaction log (bad header)")
    out: list[bytes] = []
    pos, pending = len(_WB_HEADER), b""
    while pos + 7 <= len(data):
        if _WB_BLOCK - pos % _WB_BLOCK < 7:
            pos += _WB_BLOCK - pos % _WB_BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        payload = data[pos + 7 : pos + 7 + length]
        if zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            raise InvalidInputError(f"{path}: record at byte {pos} fails its CRC check")
        pos += 7 + length
        if kind == _FULL:
            out.append(payload)
        elif kind == _FIRST:
            pending = payload
        elif kind == _MIDDLE:
            pending += payload
        elif kind == _LAST:
            out.append(pending + payload)
    return out


def read_wandb_offline(wandb_run_dir: str | Path) -> dict[str, Any]:
    """History rows and config of an offline wandb run directory (``offline-run-*``).

    Returns:
        ``{"history": [{key: value, ...}, ...], "config": {...}, "summary": {...}}`` with JSON
        values decoded, read from the run's ``run-*.wandb`` file.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    run_dir = Path(wandb_run_dir)
    files = sorted(run_dir.glob("run-*.wandb"))
    if not files:
        raise InvalidInputError(f"{run_dir} has no run-*.wandb file: not a wandb run directory")
    history: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    for raw in _wandb_records(files[0]):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            history.append(row)
        elif kind in ("config", "run"):
            updates = record.config.update if kind == "config" else record.run.config.update
            for item in updates:
                key = item.key or "/".join(item.nested_key)
                config[key] = json.loads(item.value_json)
        elif kind == "summary":
            for item in record.summary.update:
                key = item.key or "/".join(item.nested_key)
                summary[key] = json.loads(item.value_json)
    return {"history": history, "config": config, "summary": summary}


__all__ = [
    "JSONL_NAME",
    "MetricsLogger",
    "bandwidth_gbps",
    "expert_load_imbalance",
    "read_jsonl",
    "read_wandb_offline",
    "wandb_mode",
]
