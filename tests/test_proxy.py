"""Proxies over the ipc transport from Python: in-process ranks and gloo processes (CPU)."""

from __future__ import annotations

import os

import pytest

from uccl_ep_megatron import _C
from uccl_ep_megatron.core.errors import CommTimeoutError, InvalidInputError
from uccl_ep_megatron.proxy import (
    ProxyConfig,
    ProxyEndpoint,
    cmd_barrier,
    cmd_drain,
    cmd_write,
    cmd_write_atomic,
)

LEN = 64


def _pattern(src: int, ch: int, k: int) -> bytes:
    return bytes(((src * 131 + ch * 37 + k * 13 + i * 7 + 1) & 0xFF) for i in range(LEN))


def _layout(world: int, channels: int, msgs: int):
    area = world * channels * msgs * LEN

    def send(dst, ch, k):
        return ((dst * channels + ch) * msgs + k) * LEN

    def recv(src, ch, k):
        return area + ((src * channels + ch) * msgs + k) * LEN

    return 2 * area, send, recv


def _traffic(ep, region, rank, world, channels, msgs):
    """Each channel: msgs writes(+atomic on counter rank*channels+ch) to every rank, a barrier."""
    _, send, recv = _layout(world, channels, msgs)
    for d in range(world):
        for ch in range(channels):
            for k in range(msgs):
                region.write(send(d, ch, k), _pattern(rank, ch, k))
    for ch in range(channels):
        for k in range(msgs):
            for d in range(world):
                ep.push(
                    ch,
                    cmd_write_atomic(
                        d, send(d, ch, k), recv(rank, ch, k), LEN, rank * channels + ch, 1
                    ),
                )
        ep.wait(ch, ep.push(ch, cmd_drain()))
    for ch in range(channels):
        ep.wait(ch, ep.push(ch, cmd_barrier()))


def _verify(ep, region, world, channels, msgs):
    _, _, recv = _layout(world, channels, msgs)
    for src in range(world):
        for ch in range(channels):
            for k in range(msgs):
                assert region.read(recv(src, ch, k), LEN) == _pattern(src, ch, k), (src, ch, k)
    vals = ep.counter_values()
    for src in range(world):
        for ch in range(channels):
            assert vals[src * channels + ch] == msgs, (src, ch)


@pytest.mark.parametrize("reorder", [False, True], ids=["inorder", "reorder"])
def test_in_process_ranks(reorder):
    world, channels, msgs = 3, 2, 40
    size, _, _ = _layout(world, channels, msgs)
    regions = [_C.HostRegion(size) for _ in range(world)]
    cfg = ProxyConfig(
        num_channels=channels,
        num_threads=2,
        ipc_reorder=reorder,
        ipc_seed=5,
        transport="ipc",
        timeout_ms=20000,
    )
    eps = [
        ProxyEndpoint(regions[r].ptr, size, rank=r, world_size=world, config=cfg)
        for r in range(world)
    ]
    infos = [e.local_info for e in eps]
    for e in eps:
        e.connect(infos)
    try:
        import threading

        errs = []

        def run(r):
            try:
                _traffic(eps[r], regions[r], r, world, channels, msgs)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errs.append(e)

        ts = [threading.Thread(target=run, args=(r,)) for r in range(world)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errs, errs
        for r in range(world):
            _verify(eps[r], regions[r], world, channels, msgs)
            st = eps[r].stats()
            assert st["writes_posted"] == world * channels * msgs
            assert st["atomics_applied"] == world * channels * msgs
    finally:
        for e in eps:
            e.close()


def test_dead_peer_barrier_names_rank():
    world = 2
    regions = [_C.HostRegion(4096) for _ in range(world)]
    cfg = ProxyConfig(num_channels=1, num_threads=1, transport="ipc", timeout_ms=300)
    eps = [
        ProxyEndpoint(regions[r].ptr, 4096, rank=r, world_size=world, config=cfg)
        for r in range(world)
    ]
    infos = [e.local_info for e in eps]
    eps[0].connect(infos)
    eps[1].transport.connect([i.split(b"\0", 1)[1] for i in infos])  # connected, proxy never runs
    try:
        with pytest.raises(CommTimeoutError, match=r"rank\(s\) 1"):
            eps[0].wait(0, eps[0].push(0, cmd_barrier()))
    finally:
        eps[0].close()


def test_out_of_region_command_is_reported():
    regions = [_C.HostRegion(4096)]
    cfg = ProxyConfig(num_channels=1, num_threads=1, transport="ipc", timeout_ms=2000)
    ep = ProxyEndpoint(regions[0].ptr, 4096, rank=0, world_size=1, config=cfg)
    ep.connect([ep.local_info])
    try:
        with pytest.raises(InvalidInputError, match="outside the registered regions"):
            ep.wait(0, ep.push(0, cmd_write(0, 0, 4096, 16)))
    finally:
        ep.close()


def test_config_validation():
    with pytest.raises(InvalidInputError, match="ordering"):
        ProxyConfig(ordering="fast").resolved()
    with pytest.raises(InvalidInputError, match="fifo_capacity"):
        ProxyConfig(fifo_capacity=1000).resolved()
    with pytest.raises(InvalidInputError, match="num_threads"):
        ProxyConfig(num_channels=2, num_threads=4).resolved()


def test_env_drives_defaults(monkeypatch):
    monkeypatch.setenv("UCCL_EP_NUM_PROXY_THREADS", "3")
    monkeypatch.setenv("UCCL_EP_PROXY_ORDERING", "sender")
    cfg = ProxyConfig(num_channels=4).resolved()
    assert (cfg.num_threads, cfg.ordering) == (3, "sender")


# ---- multi-process: one proxy per gloo rank, host regions in shared memory ----
def _dist_body(rank, world, reorder):
    channels, msgs = 2, 30
    size, _, _ = _layout(world, channels, msgs)
    region = _C.HostRegion(size, True)
    cfg = ProxyConfig(
        num_channels=channels,
        num_threads=2,
        transport="ipc",
        ipc_reorder=reorder,
        ipc_seed=11,
        timeout_ms=30000,
    )
    ep = ProxyEndpoint(region.ptr, size, shm_name=region.shm_name, config=cfg)
    ep.connect()
    try:
        _traffic(ep, region, rank, world, channels, msgs)
        _verify(ep, region, world, channels, msgs)
        return ep.stats()
    finally:
        import torch.distributed as dist

        dist.barrier()  # peers may still read our inbox/region until everyone is done
        ep.close()


@pytest.mark.parametrize("reorder", [False, True], ids=["inorder", "reorder"])
def test_gloo_processes(pool2, reorder):
    stats = pool2.run(os.path.abspath(__file__), "_dist_body", reorder)
    for s in stats:
        assert s["atomics_applied"] == 2 * 2 * 30


def test_bench_ordering_cli(tmp_path, capsys):
    from uccl_ep_megatron import cli

    out = tmp_path / "ordering.json"
    rc = cli.main(["bench", "ordering", "--msgs", "200", "--delay-us", "0,50", "--json", str(out)])
    assert rc == 0
    import json

    rows = json.loads(out.read_text())["rows"]
    assert [(r["delay_us"], r["ordering"]) for r in rows] == [
        (0, "receiver"),
        (0, "sender"),
        (50, "receiver"),
        (50, "sender"),
    ]
    assert all(r["chunks"] == 2 * 2 * 200 and r["seconds"] > 0 for r in rows)
    # Without the injector nothing arrives early; with it the receiver held early messages.
    assert rows[0]["held_out_of_order"] == 0
    assert rows[2]["held_out_of_order"] > 0
    assert "ordering" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--bytes", str(_C.cmd_limits["max_length"] + 1)], "exceeds what one write command"),
        (["--threads", "3", "--channels", "2"], "--threads=3"),
    ],
)
def test_bench_ordering_rejects_bad_arguments_at_once(argv, needle, capsys):
    # An invalid length used to kill the producer threads silently and leave the bench polling
    # the counters for two minutes before a misleading "counters stuck".
    import time

    from uccl_ep_megatron import cli

    t0 = time.monotonic()
    assert cli.main(["bench", "ordering", "--msgs", "10", "--delay-us", "0", *argv]) == 2
    assert time.monotonic() - t0 < 10
    err = capsys.readouterr().err.strip()
    assert err.startswith("uccl-ep-megatron bench: error:") and needle in err, err


# ---- raw addresses crossing into _C are checked (a bad one used to segfault the process) ------
def test_transport_rejects_a_region_that_no_allocation_backs():
    with pytest.raises(InvalidInputError, match="allocate it with _C.HostRegion"):
        _C.IpcTransport(0, 1, 1, 1, 0x1000, 4096)
    with pytest.raises(InvalidInputError, match="null pointer"):
        _C.IpcTransport(0, 1, 1, 1, 0, 4096)


def test_proxy_endpoint_rejects_region_bytes_past_the_allocation():
    region = _C.HostRegion(4096)
    cfg = ProxyConfig(num_channels=1, num_threads=1, transport="ipc")
    with pytest.raises(InvalidInputError, match=r"\[0x[0-9a-f]+, \+8192\) must lie inside one"):
        ProxyEndpoint(region.ptr, 8192, rank=0, world_size=1, config=cfg)
    with pytest.raises(InvalidInputError, match="at offset 2048"):
        ProxyEndpoint(region.ptr + 2048, 4096, rank=0, world_size=1, config=cfg)
    ep = ProxyEndpoint(region.ptr + 2048, 2048, rank=0, world_size=1, config=cfg)  # inside: fine
    ep.connect([ep.local_info])
    ep.close()


def test_a_freed_host_region_is_no_longer_accepted():
    region = _C.HostRegion(4096)
    ptr = region.ptr
    del region
    with pytest.raises(InvalidInputError, match="no live allocation"):
        _C.IpcTransport(0, 1, 1, 1, ptr, 4096)
