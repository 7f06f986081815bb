"""FIFO channels and TransferCmd packing through the Python bindings (CPU)."""

from __future__ import annotations

import random
import threading

import pytest

from uccl_ep_megatron import _C
from uccl_ep_megatron.core.errors import CommTimeoutError, InvalidInputError
from uccl_ep_megatron.proxy import cmd_atomic, cmd_barrier, cmd_drain, cmd_write, cmd_write_atomic

LIM = _C.cmd_limits


def test_cmd_roundtrip_random_fields():
    rng = random.Random(3)
    for _ in range(2000):
        f = dict(
            dst_rank=rng.randrange(LIM["max_ranks"]),
            src_offset=rng.randrange(LIM["max_src_offset"] // 16 + 1) * 16,
            dst_offset=rng.randrange(LIM["max_dst_offset"] // 16 + 1) * 16,
            length=rng.randrange(LIM["max_length"] + 1),
            index=rng.randrange(LIM["num_atomic_counters"]),
            value=rng.randint(LIM["min_atomic_value"], LIM["max_atomic_value"]),
        )
        d = _C.cmd_decode(*cmd_write_atomic(**f))
        assert d["type"] == "Write" and d["has_atomic"]
        assert (d["dst_rank"], d["src_offset"], d["dst_offset"], d["length"]) == (
            f["dst_rank"],
            f["src_offset"],
            f["dst_offset"],
            f["length"],
        )
        assert (d["atomic_index"], d["atomic_value"]) == (f["index"], f["value"])


def test_other_command_types():
    assert _C.cmd_decode(*cmd_write(1, 16, 32, 48))["has_atomic"] is False
    a = _C.cmd_decode(*cmd_atomic(2, 7, -5))
    assert (a["type"], a["dst_rank"], a["atomic_index"], a["atomic_value"]) == ("Atomic", 2, 7, -5)
    assert _C.cmd_decode(*cmd_drain())["drain_all"] is True
    d = _C.cmd_decode(*cmd_drain(0x1_0000_0005))
    assert d["type"] == "Drain" and d["drain_index_low32"] == 5 and not d["drain_all"]
    assert _C.cmd_decode(*cmd_barrier(True))["barrier_same_rail"] is True


@pytest.mark.parametrize(
    "args, needle",
    [
        ((LIM["max_ranks"], 0, 0, 16), "dst_rank"),
        ((0, 8, 0, 16), "multiples of 16"),
        ((0, 0, 0, LIM["max_length"] + 1), "length="),
    ],
)
def test_bad_write_names_the_field(args, needle):
    with pytest.raises(InvalidInputError, match=needle):
        cmd_write(*args)


def test_bad_atomic_value():
    with pytest.raises(InvalidInputError, match="atomic_value"):
        cmd_atomic(0, 0, LIM["max_atomic_value"] + 1)


def test_fifo_order_wraparound_and_poll_is_not_pop():
    ch = _C.FifoChannel.host(0, 4, 1000)
    assert ch.poll() is None
    for i in range(25):
        idx = ch.push(*cmd_write(i % 5, 0, 0, i))
        assert idx == i
        assert ch.poll() == ch.poll()
        assert _C.cmd_decode(*ch.poll())["length"] == i
        assert not ch.check_completion(idx)
        ch.pop()
        assert ch.check_completion(idx)
        assert ch.poll() is None


def test_full_ring_times_out_with_channel_and_index():
    ch = _C.FifoChannel.host(6, 2, 50)
    ch.push(*cmd_barrier())
    ch.push(*cmd_barrier())
    with pytest.raises(CommTimeoutError, match=r"channel 6.*index 2"):
        ch.push(*cmd_barrier())


def test_concurrent_producers_exactly_once():
    ch = _C.FifoChannel.host(0, 16, 20000)
    n, producers = 3000, 3

    def produce(p):
        for i in range(n):
            ch.push(*cmd_write(p, 0, 0, i))

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in threads:
        t.start()
    nxt = [0] * producers
    got = 0
    while got < n * producers:
        c = ch.poll()
        if c is None:
            continue
        d = _C.cmd_decode(*c)
        assert d["length"] == nxt[d["dst_rank"]]
        nxt[d["dst_rank"]] += 1
        ch.pop()
        got += 1
    for t in threads:
        t.join()
    assert nxt == [n] * producers


def test_bad_capacity():
    with pytest.raises(InvalidInputError, match="power of two"):
        _C.FifoChannel.host(0, 1000, 100)


def test_bench_fifo_without_gpu_explains(capsys):
    import torch

    from uccl_ep_megatron import cli

    if torch.cuda.is_available():
        pytest.skip("a GPU is present; tests/gpu/test_fifo_gpu.py covers the benchmark")
    assert cli.main(["bench", "fifo", "--threads", "1"]) == 2  # one line, no traceback
    err = capsys.readouterr().err.strip()
    assert err.startswith("uccl-ep-megatron bench: error: bench fifo") and "\n" not in err


@pytest.mark.parametrize("threads", ["x", "0", "1,-2", ""])
def test_bench_fifo_rejects_bad_threads(threads, capsys):
    # Argument errors come before the GPU check, so they are reported (and tested) anywhere.
    from uccl_ep_megatron import cli

    assert cli.main(["bench", "fifo", "--threads", threads]) == 2
    assert "--threads" in capsys.readouterr().err
