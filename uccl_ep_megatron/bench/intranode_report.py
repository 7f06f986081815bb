"""``bench intranode`` in the launching process: every rank's timings merged into one result per
rank count (per-iteration maximum over ranks, then median / min / max; GB/s, floor and DeepEP
ratios) and printed as one table."""

from __future__ import annotations

import statistics


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def merge(per_rank: list[dict], shared: bool) -> dict:
    """One result for the rank count: per-iteration max over ranks, then median/min/max."""
    r0 = per_rank[0]
    world = r0["world"]
    out = {k: r0[k] for k in ("world", "tokens", "hidden", "experts", "topk", "device", "deepep")}
    out["shared_gpu"] = shared
    out["arena_fallbacks"] = [r.get("arena_fallbacks", 0) for r in per_rank]
    # Each rank's CPU speed before and after its timed calls (bench.common.cpu_probe_ms).
    out["cpu_probe_ms"] = [r.get("cpu_probe_ms", []) for r in per_rank]
    out["launch_ahead"] = r0.get("launch_ahead", {})  # rank 0's [served, ran again] per Buffer
    # Rank 0's [combines in place, of them copied into the arena first, by the copy engine]
    # per Buffer.
    out["combine_paths"] = r0.get("combine_paths", {})
    out["recv_bytes"] = max(r["recv_bytes"] for r in per_rank)
    if shared:
        moved = 2 * sum(r["recv_bytes"] for r in per_rank)  # every row read once, written once
        bw = r0["floor_Bps"]
        out["floor"] = {"what": "HBM read+write of all ranks' rows", "GBps": bw / 1e9}
    else:
        moved = max(r["cross_bytes"] for r in per_rank)
        bw = min(r["floor_Bps"] for r in per_rank)
        out["floor"] = {"what": "peer copy of the rows crossing the link", "GBps": bw / 1e9}
    out["floor"]["us"] = moved / bw * 1e6
    out["agreement"] = [r["agreement"] for r in per_rank]
    if "nccl" in r0:
        out["nccl"] = _max_over_ranks([r["nccl"] for r in per_rank])
    rows = []
    for i, t0 in enumerate(r0["timings"]):
        row = {k: t0[k] for k in ("op", "impl", "copy", "sms")}
        row.update(_max_over_ranks([r["timings"][i] for r in per_rank]))
        byts = out["recv_bytes"] * ((1 + 4 / 128) / 2 if "fp8" in row["op"] else 1.0)
        row["GBps"] = byts / (row["device_us"]["median"] * 1e-6) / 1e9
        rows.append(row)
    out["rows"] = rows
    for row in rows:
        if row["impl"] != "ours":
            continue
        same = [
            q
            for q in rows
            if q["impl"] == "deepep"
            and q["op"] == row["op"]
            and (q["sms"] == row["sms"] or per_rank[0]["deepep_sms"])
        ]
        peer = same[0] if same else None
        if peer is not None:
            row["vs_deepep"] = row["device_us"]["median"] / peer["device_us"]["median"]
    out["kernels"] = r0["kernels"]
    out["world"] = world
    return out


def _max_over_ranks(timings: list[dict]) -> dict[str, dict[str, float]]:
    res = {}
    for key in ("device_us", "host_us"):
        per_iter = [max(vals) for vals in zip(*(t[key] for t in timings), strict=True)]
        res[key] = _stats(per_iter)
    return res


def print_table(r: dict) -> None:
    mode = "ranks sharing GPUs under MPS (gloo)" if r["shared_gpu"] else "one rank per GPU (NCCL)"
    print(
        f"# bench intranode: {r['world']} ranks, {mode}, {r['device']}; {r['tokens']} tok/rank, "
        f"hidden {r['hidden']}, top-{r['topk']} of {r['experts']} (max over ranks per iteration)"
    )
    f = r["floor"]
    print(f"# floor: {f['what']} at {f['GBps']:.0f} GB/s -> {f['us']:.1f} us")
    probes = "; ".join(
        f"rank {i} " + " -> ".join(f"{v:.2f}" for v in p) for i, p in enumerate(r["cpu_probe_ms"])
    )
    print(f"# CPU probe, ms before -> after (a fixed Python loop; host us grow with it): {probes}")
    if "nccl" in r:
        print(f"# NCCL all_to_all_single of dedup rows: {r['nccl']['device_us']['median']:.1f} us")
    if r["deepep"]:
        bad = [
            (i, k, v)
            for i, ag in enumerate(r["agreement"])
            for k, v in _flat(ag)
            if v is False or (k.endswith("max_abs_diff") and v > 0.05)
        ]
        print("# ours vs DeepEP V1 outputs: " + ("identical" if not bad else f"DIFFER {bad[:4]}"))
    for label, (served, again) in r.get("launch_ahead", {}).items():
        print(f"# launch-ahead ({label}, rank 0): {served} exact dispatches served, {again} rerun")
    for label, (placed, copied, *engine) in r.get("combine_paths", {}).items():
        line = f"# combines in place ({label}, rank 0): {placed}, {copied} of them copied in first"
        if engine:
            line += f"; by the copy engine: {engine[0]}"
        print(line)
    print(
        f"{'op':<22}{'impl':>7}{'copy':>7}{'SMs':>4}{'device us':>10}{'(min-max)':>16}"
        f"{'host us':>9}{'GB/s':>7}{'/floor':>7}{'/DeepEP':>8}"
    )
    for row in r["rows"]:
        d, h = row["device_us"], row["host_us"]
        ratio = f"{row['vs_deepep']:.2f}" if "vs_deepep" in row else "-"
        spread = f"({d['min']:.0f}-{d['max']:.0f})"
        print(
            f"{row['op']:<22}{row['impl']:>7}{row['copy']:>7}{row['sms']:>4}{d['median']:>10.1f}"
            f"{spread:>16}{h['median']:>9.1f}{row['GBps']:>7.1f}"
            f"{d['median'] / r['floor']['us']:>7.2f}{ratio:>8}"
        )


def print_kernels(r: dict) -> None:
    """Rank 0's mean device us per kernel per call (``--kernels``), largest first."""
    for k in r.get("kernels", []):
        parts = sorted(k["us"].items(), key=lambda kv: -kv[1])
        total = sum(v for _, v in parts)
        shown = ", ".join(f"{n} {v:.1f}" for n, v in parts[:5])
        print(f"# kernels {k['op']} {k['impl']} {k['sms']} SMs: {total:.1f} us = {shown}")


def ratio_medians(results: list[dict]) -> list[dict]:
    """Every row of ours that has a DeepEP ratio, per rank count: its ratio in each result
    (one per ``--repeat`` run, in run order) and their median."""
    runs: dict[tuple, list[float]] = {}
    for r in results:
        for row in r["rows"]:
            if "vs_deepep" in row:
                key = (r["world"], row["op"], row["copy"], row["sms"])
                runs.setdefault(key, []).append(row["vs_deepep"])
    return [
        {"world": w, "op": op, "copy": c, "sms": s, "ratios": v, "median": statistics.median(v)}
        for (w, op, c, s), v in runs.items()
    ]


def print_repeats(summary: list[dict]) -> None:
    """The ``ratio_medians`` table (nothing for a single run)."""
    if not summary:
        return
    print("# ours / DeepEP V1 device time per run (fresh rank processes each) and the median")
    for row in summary:
        each = " ".join(f"{x:.2f}" for x in row["ratios"])
        print(
            f"{row['world']:>2} ranks {row['op']:<22}{row['copy']:>7}{row['sms']:>4}  {each}"
            f"  median {row['median']:.2f}"
        )


def _flat(ag: dict, prefix: str = ""):
    for k, v in ag.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


__all__ = ["merge", "print_kernels", "print_repeats", "print_table", "ratio_medians"]
