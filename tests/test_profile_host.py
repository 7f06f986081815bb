"""bench/profile_host.py's summary (what it prints and what ``--json`` writes), from made-up
per-rank timings: medians over iterations of the maximum over ranks (without stamps and with
them), rank 0's split, the start spread, every rank's own medians."""

from __future__ import annotations

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module():
    spec = importlib.util.spec_from_file_location(
        "profile_host", os.path.join(ROOT, "bench", "profile_host.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _per_rank(ops):
    """Two ranks, three iterations; ours with stamps, DeepEP without (its calls are not split)."""
    ranks = []
    for r in range(2):
        res = {"fallbacks": r, "cpus": [8 * r, 8 * r + 7], "floor": {"op": 1.5} if r == 0 else {}}
        res["protocol"] = {"release": 3.5 + r, "sync": 50.0 + r, "sync+barrier": 60.0 + r}
        res["cpu_probe_ms"] = [2.5 + r, 4.25 - r]
        for k, op in enumerate(ops):
            base = 10.0 * (k + 1)
            # Rank 1 is slower on iteration 0 only, rank 0 on iterations 1 and 2.
            host = [base + (9 if r == 1 else 0), base + (5 if r == 0 else 1), base + 3 - r]
            dev = [100 + x for x in host]
            stamps = [(1000 * i + 500 * r, 1000 * i + 500 * r + 2000) for i in range(3)]
            seg = {"py->dispatch_begin": base / 2 + r, "py->return": base / 4}
            res[f"{op}/ours"] = {
                "host": host,
                "host_stamped": [x + 20 for x in host],  # the stamps' own cost
                "dev": dev,
                "seg": seg,
                "prof": "",
                "stamps": stamps,
            }
            res[f"{op}/deepep"] = {"host": [x / 2 for x in host], "dev": dev, "seg": {}, "prof": ""}
        ranks.append(res)
    return ranks


def test_summary_is_the_median_of_the_maximum_over_ranks(tmp_path, capsys):
    mod = _module()
    per_rank = _per_rank(mod.OPS)
    s = mod._summary(2, per_rank, 3)
    assert s["impls"] == ["ours", "deepep"]
    for k, op in enumerate(mod.OPS):
        base = 10.0 * (k + 1)
        # max over ranks per iteration: base+9, base+5, base+3 -> median base+5
        assert s["ops"][op]["ours"]["host_us"] == base + 5
        assert s["ops"][op]["ours"]["dev_us"] == 100 + base + 5
        assert s["ops"][op]["deepep"]["host_us"] == (base + 5) / 2
        assert s["ops"][op]["ours"]["host_stamped_us"] == base + 25
        assert "host_stamped_us" not in s["ops"][op]["deepep"]
        # rank 1 starts 500 ns after rank 0 and its first launch is queued 2000 ns after its start
        assert s["ops"][op]["ours"]["start_spread_us"] == 0.5
        assert s["ops"][op]["ours"]["last_first_launch_us"] == 2.5
        assert "start_spread_us" not in s["ops"][op]["deepep"]
        assert s["ops"][op]["split_rank0_us"] == {
            "py->dispatch_begin": base / 2,
            "py->return": base / 4,
        }
        # rank 0: base, base+5, base+3 -> base+3; rank 1: base+9, base+1, base+2 -> base+2
        assert [p["host_us"] for p in s["ops"][op]["per_rank"]] == [base + 3, base + 2]
    assert s["arena_fallbacks"] == [0, 1]
    assert s["floor_us"] == {"op": 1.5}
    assert s["protocol_rank0_us"] == {"release": 3.5, "sync": 50.0, "sync+barrier": 60.0}
    assert s["cpu_probe_ms"] == [[2.5, 4.25], [3.5, 3.25]]

    path = tmp_path / "out.json"
    mod.write_json(str(path), [s])
    assert json.loads(path.read_text()) == [s]

    mod._report(s)
    text = capsys.readouterr().out
    first = mod.OPS[0]
    row = next(line for line in text.splitlines() if line.startswith(first))
    assert row.split()[1:6] == ["15.0", "115.0", "7.5", "115.0", "35.0:"], row
    assert "call starts spread 0.5 us; last rank's first launch 2.5 us" in text
    assert "rank 1: host 12.0 dev 112.0" in text
    assert "arena fallbacks per rank: [0, 1]" in text
    assert "rank 1 CPUs: 2 (8-15); CPU probe 3.50 -> 3.25 ms" in text
    lines = text.splitlines()
    assert any(x.startswith("releasing the previous result") and x.endswith(" 3.5") for x in lines)
    assert any(x.startswith("call after sync+barrier") and x.endswith(" 60.0") for x in lines)


def test_protocol_times_the_release_apart_from_each_condition_s_call(monkeypatch):
    """``--protocol``: each condition runs before its own call, in turn per iteration, and
    releasing the previous result is timed apart (here it takes 2 ms, the calls none)."""
    import time

    mod = _module()
    monkeypatch.setattr(mod.torch.cuda, "synchronize", lambda: None)
    order: list[str] = []
    monkeypatch.setattr(
        mod, "PROTOCOL", {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    )
    released: list[int] = []

    class Result:
        def __del__(self):
            time.sleep(0.002)
            released.append(1)

    def call():
        order.append("call")
        return Result()

    state: dict = {}
    out = mod._protocol(state, call, 3)
    assert order == ["a", "call", "b", "call"] * 3
    assert len(released) == 5 and "out" in state  # every result but the last, before a call
    assert set(out) == {"release", "a", "b"}
    assert out["release"] >= 2000  # the medians of six releases, five of them slow
    assert out["a"] < 1000 and out["b"] < 1000
