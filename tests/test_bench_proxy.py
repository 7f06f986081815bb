"""``bench proxy``: CPU producers through real proxies and the ipc NIC model on host memory.
Every write must arrive (the receiver's counters, the sender's posted writes), the rates must be
the counts over the time, bad flags are named, and a proxy that stops consuming ends the test
with an error instead of a hang."""

from __future__ import annotations

import argparse
import json
import time

import pytest

from uccl_ep_megatron import cli
from uccl_ep_megatron.bench import proxy
from uccl_ep_megatron.core import _c
from uccl_ep_megatron.core.errors import InvalidInputError


def _args(**over) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    proxy.add_arguments(parser)
    a = parser.parse_args([])
    base = dict(threads="1,2", channels=2, bytes="4096", writes=300, repeats=1, timeout_ms=20000)
    for k, v in {**base, **over}.items():
        setattr(a, k, v)
    return a


@pytest.mark.parametrize("atomic_every", [1, 3, 0])
def test_every_write_and_counter_arrives_and_the_rates_are_the_counts_over_the_time(atomic_every):
    a = _args(atomic_every=atomic_every)
    rows = proxy.measure(a)
    assert [(r["threads"], r["write_bytes"]) for r in rows] == [(1, 4096), (2, 4096)]
    for r in rows:
        # measure() waited for rank 1's counters to reach writes // atomic_every each.
        assert r["writes"] == 300 * 2
        assert r["writes_posted"] == r["writes"]  # the sender proxy's own count
        assert r["commands"] == 2 * (300 + 1)  # the writes and one Drain(all) per channel
        secs = r["seconds"]
        assert r["mcmds_per_s"] == pytest.approx(r["commands"] / secs / 1e6)
        assert r["kcmds_per_s_per_thread"] == pytest.approx(
            r["commands"] / secs / r["threads"] / 1e3
        )
        assert r["gbps"] == pytest.approx(600 * 4096 / secs / 1e9)
        assert r["vs_nic"] == pytest.approx(600 / secs / 1e6 / r["nic_alone_mwrites_per_s"])
        assert r["nic_alone_mwrites_per_s"] > 0 and r["spread"] == 1.0
        assert min(r["sender_proxy_cores"], r["receiver_proxy_cores"], r["nic_cores"]) >= 0


def test_json_and_the_cli_entry(tmp_path, capsys):
    out = tmp_path / "proxy.json"
    rc = cli.main(
        ["bench", "proxy", "--threads", "1", "--channels", "1", "--bytes", "8192", "--writes",
         "100", "--repeats", "2", "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["bench"] == "proxy" and res["meta"]["channels"] == 1
    (row,) = res["rows"]
    assert row["write_bytes"] == 8192 and row["writes_posted"] == 100
    # 1 producer + 2 proxy threads + 2 NIC threads poll at once.
    assert res["meta"]["oversubscribed"] == (5 > res["meta"]["host_cpus"])
    text = capsys.readouterr().out
    assert "vs NIC" in text and ("WARNING" in text) == res["meta"]["oversubscribed"]


@pytest.mark.parametrize(
    "over, named",
    [
        (dict(threads="0"), "--threads"),
        (dict(threads="a"), "--threads"),
        (dict(threads="4", channels=2), "--threads"),
        (dict(bytes="100"), "--bytes"),
        (dict(channels=0), "--channels"),
        (dict(writes=0), "--writes"),
        (dict(atomic_every=-1), "--atomic-every"),
        (dict(link_gbps=-1.0), "--link-gbps"),
    ],
)
def test_bad_flags_are_named(over, named):
    with pytest.raises(InvalidInputError, match=named):
        proxy.check_args(_args(**over))


def test_producers_of_a_proxy_that_never_consumes_fail_with_the_channel_named():
    """No proxy pops the rings: the pushes past their capacity give up after the channel's
    timeout, the first failure is raised and the other producer is released."""
    c = _c.load()
    chans = [c.FifoChannel.host(i, 4, 300) for i in range(2)]
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="FIFO channel [01]"):
        c.proxy_push_test(chans, 1, 0, 4096, 4096, 4096, 50, 1)
    assert time.monotonic() - t0 < 5.0


def test_the_push_test_rejects_sizes_it_cannot_cycle():
    c = _c.load()
    chans = [c.FifoChannel.host(0, 4, 300)]
    with pytest.raises(Exception, match="span"):
        c.proxy_push_test(chans, 1, 0, 4096, 1024, 4096, 10, 1)
