"""Raw addresses that cross into ``_C`` on a GPU: freed, interior, of the wrong kind or too
short must raise ``InvalidInputError``, and the CUDA context must still work afterwards
(nothing reached a kernel or the driver). Made-up addresses without any allocation are in
``tests/test_bindings_checks.py``, which needs no GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from uccl_ep_megatron import _C
from uccl_ep_megatron.core.errors import InvalidInputError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not _C.kernels_built(),
        reason="needs a GPU and a GPU build of uccl_ep_megatron",
    ),
]


def _context_alive() -> None:
    t = torch.arange(1024, device="cuda")
    assert int(t.sum()) == 1024 * 1023 // 2
    torch.cuda.synchronize()


def test_status_words():
    buf = _C.device_alloc_zeroed(1 << 20)
    with pytest.raises(InvalidInputError, match="must lie inside one status words"):
        _C.host_status_read(buf)  # a device buffer is not a status block
    st = _C.host_status_alloc()
    assert _C.host_status_read(st) == [0, 0, 0, 0]
    with pytest.raises(InvalidInputError, match="non-zero code"):
        _C.host_status_record(st, [0, 1, 2, 3])
    _C.host_status_record(st, [1, 5, 6, 7])
    _C.host_status_record(st, [2, 8, 9, 10])  # the first failure wins
    assert _C.host_status_read(st) == [1, 5, 6, 7]
    _C.host_status_free(st)
    with pytest.raises(InvalidInputError, match="not the start of a live status words"):
        _C.host_status_free(st)  # a second free
    with pytest.raises(InvalidInputError):
        _C.host_status_read(st)  # use after free
    _C.device_free(buf)
    _context_alive()


def test_device_buffers_and_ipc():
    buf = _C.device_alloc_zeroed(4096)
    with pytest.raises(InvalidInputError, match="not the start"):
        _C.device_free(buf + 256)  # interior pointer
    other = _C.device_alloc_zeroed(4096)
    _C.device_copy(other, buf, 4096)
    with pytest.raises(InvalidInputError, match=r"\+4097\) must lie inside one"):
        _C.device_copy(other, buf, 4097)
    with pytest.raises(InvalidInputError, match="device_copy: dst"):
        _C.device_copy(other + 2048, buf, 4096)
    with pytest.raises(InvalidInputError, match="not the start"):
        _C.ipc_get_handle(buf + 16)
    with pytest.raises(InvalidInputError, match="not the start of a live IPC mapping"):
        _C.ipc_close_handle(buf)  # our own buffer is no mapping
    _C.device_free(other)
    _C.device_free(buf)
    with pytest.raises(InvalidInputError, match="not the start"):
        _C.device_free(buf)  # a second free
    _context_alive()


def _context(buffers, nbytes, status, **kw):
    """A 2-rank ``_C.IntranodeContext`` on rank 0 (keyword-only, as every field is named)."""
    return _C.IntranodeContext(
        buffers=buffers,
        buffer_bytes=nbytes,
        rank=0,
        num_ranks=2,
        status=status,
        timeout_ns=10**9,
        use_tma=False,
        **kw,
    )


def test_kernel_launch_with_a_made_up_buffer_raises_before_launch():
    dev = torch.device("cuda")
    st = _C.host_status_alloc()
    per_rank = torch.zeros(2, dtype=torch.int32, device=dev)
    per_expert = torch.zeros(4, dtype=torch.int32, device=dev)
    info = torch.empty(4, dtype=torch.int32, device=dev)
    in_rank = torch.zeros(0, 2, dtype=torch.bool, device=dev)
    nbytes = int(_C.KERNELS_DATA_OFFSET)
    buf = _C.device_alloc_zeroed(nbytes)
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(InvalidInputError, match=r"buffers\[1\]"):
        _context([buf, 0xDEAD0000], nbytes, st)
    with pytest.raises(InvalidInputError, match="status"):
        _context([buf, buf], nbytes, 0)
    ctx = _context([buf, buf], nbytes, st)
    # A cached launch: no readback, no send_pos read, no per-expert counts.
    cached = _C.DispatchLaunch(num_sms=2, experts_per_rank=0, num_experts=0, header=0, cached=True)
    inputs = SimpleNamespace(
        is_token_in_rank=in_rank,
        num_tokens_per_rank=per_rank,
        num_tokens_per_expert=None,
        topk_idx=None,
    )

    def notify(launch=cached, info=info, entry=(), **change):
        given = SimpleNamespace(**{**vars(inputs), **change})
        _C.intranode_notify_call(ctx, launch, stream, given, info, None, list(entry))

    with pytest.raises(InvalidInputError, match="out_info is None"):
        notify(info=None)
    two_experts = _C.DispatchLaunch(
        num_sms=2, experts_per_rank=2, num_experts=4, header=0, num_worst_tokens=8
    )
    with pytest.raises(InvalidInputError, match=r"out_info has shape \[4\]; expected 1-D with 6"):
        notify(two_experts, num_tokens_per_expert=per_expert)
    with pytest.raises(InvalidInputError, match="num_tokens_per_rank has dtype int64"):
        notify(num_tokens_per_rank=per_rank.long())
    # Zero-copy receive: arenas come one per rank with their sizes, and a receive entry
    # naming arena offsets needs them.
    with pytest.raises(InvalidInputError, match="1 receive arenas and 1 sizes for 2 ranks"):
        _context([buf, buf], nbytes, st, arenas=[buf], arena_sizes=[nbytes])
    with pytest.raises(InvalidInputError, match="zero-copy recv_entry but no receive arenas"):
        notify(entry=[1, 0, -1, -1, -1, 0])
    with pytest.raises(InvalidInputError, match="recv_entry has 2 words"):
        notify(entry=[1, 0])
    _C.device_free(buf)
    # A context outliving its buffers raises at the call (checked again each time).
    with pytest.raises(InvalidInputError, match=r"intranode_notify: buffers\[0\]"):
        notify()
    _C.host_status_free(st)
    _context_alive()


# A 2-rank intranode context with receive arenas (both ranks' buffers and arenas are this
# process's own, so nothing may launch) and a small call's tensors: T tokens of H bf16, K ids.
T, H, K = 4, 64, 2
ARENA_BYTES = 1 << 20


@pytest.fixture
def arena_ctx():
    dev = torch.device("cuda")
    st = _C.host_status_alloc()
    nbytes = int(_C.KERNELS_DATA_OFFSET) + (4 << 20)  # staging for the arena's rows and more
    buf = _C.device_alloc_zeroed(nbytes)
    arena = _C.device_alloc_zeroed(ARENA_BYTES)
    ns = SimpleNamespace(
        st=st,
        ctx=_context([buf, buf], nbytes, st, arenas=[arena, arena], arena_sizes=[ARENA_BYTES] * 2),
        core=_C.RecvArenaCore(arena, ARENA_BYTES, torch.cuda.current_device(), True),
        stream=torch.cuda.current_stream().cuda_stream,
        # A DispatchArgs' tensors, as the bindings read them (by name).
        inputs=SimpleNamespace(
            x=torch.zeros(T, H, dtype=torch.bfloat16, device=dev),
            x_scales=None,
            topk_idx=torch.zeros(T, K, dtype=torch.int64, device=dev),
            topk_weights=torch.zeros(T, K, device=dev),
            is_token_in_rank=torch.zeros(T, 2, dtype=torch.bool, device=dev),
            num_tokens_per_rank=torch.zeros(2, dtype=torch.int32, device=dev),
            num_tokens_per_expert=torch.zeros(4, dtype=torch.int32, device=dev),
        ),
    )
    yield ns
    torch.cuda.synchronize()
    assert ns.core.close(False), "a test left a receive-arena block alive"
    _C.device_free(arena)
    _C.device_free(buf)
    _C.host_status_free(st)
    _context_alive()


def test_dispatch_checks_a_reservation_against_its_call(arena_ctx):
    # A launch-ahead dispatch passes a receive-arena reservation as its outputs (their tensors
    # are made after the launch): one made for other rows, or outputs that are neither a
    # reservation nor the five tensors, raise before anything is launched.
    a = arena_ctx
    info = torch.zeros(5, dtype=torch.int32, device="cuda")
    send_pos = torch.zeros(T, 2, dtype=torch.int32, device="cuda")
    launch = _C.DispatchLaunch(num_sms=2, experts_per_rank=1, num_experts=2, header=0)
    rows = _C.DispatchRows.of_bound(8)

    def call(outputs):
        _C.intranode_dispatch_call(a.ctx, launch, rows, a.stream, a.inputs, info, send_pos, outputs)

    wide = a.core.reserve(8, 2 * H, 4, 16, 0, K, 64, True, a.stream, a.stream)
    with pytest.raises(InvalidInputError, match="reservation was made for rows of 256 bytes"):
        call(wide)
    with pytest.raises(InvalidInputError, match="outputs must be a RecvReservation or the tuple"):
        call((None, None, None, None))
    del wide


def test_transport_region_past_a_tensor_end_raises():
    region = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
    with pytest.raises(InvalidInputError, match="runs past the end of the device allocation"):
        _C.IpcTransport(0, 1, 1, 1, region.data_ptr(), 1 << 40, torch.cuda.current_device())
    with pytest.raises(InvalidInputError, match="not device memory"):
        _C.IpcTransport(0, 1, 1, 1, 0x1000, 4096, torch.cuda.current_device())
    _context_alive()


def test_internode_calls_check_their_tensors_before_launch():
    # Every call below must raise before any launch: a valid one would start kernels that wait
    # for proxies this test does not run.
    dev = torch.device("cuda")
    c_in = _C.internode
    region_bytes = 1 << 20
    region = _C.device_alloc_zeroed(region_bytes)
    nvl = _C.device_alloc_zeroed(1 << 16)
    st = c_in.status_alloc()
    counters = _C.Counters(int(c_in.NUM_COUNTERS), True)
    fifo = torch.zeros(8 * 64, dtype=torch.uint8, device=dev)  # 8 FifoDeviceHandles
    state = torch.zeros(int(c_in.STATE_WORDS), dtype=torch.int64, device=dev)
    with pytest.raises(InvalidInputError, match="internode Context: counters"):
        c_in.Context(0, 2, 1, fifo, 8, 0xDEAD0000, state, region, region_bytes, [nvl], 4096, st, 1)
    # Two nodes of one rank each, 2 channels; rows of 64 bf16 (128 bytes).
    ctx = c_in.Context(
        0, 2, 1, fifo, 8, counters.dev_ptr, state, region, region_bytes, [nvl], 4096, st, 10**9
    )
    stream = torch.cuda.current_stream().cuda_stream
    T, H, R, N, L, C, rows = 4, 64, 2, 2, 1, 2, 6
    i32 = {"dtype": torch.int32, "device": dev}
    bf16 = {"dtype": torch.bfloat16, "device": dev}
    f32 = {"dtype": torch.float32, "device": dev}
    from uccl_ep_megatron.backends.internode.launch import (
        InternodeCombineTensors,
        InternodeDispatchTensors,
        RingShape,
    )

    rings = RingShape(channels=C, slots=8, chunk=4)
    d = {  # the fields of InternodeDispatchTensors
        "x": torch.zeros(T, H, **bf16),
        "x_scales": None,
        "topk_idx": None,
        "topk_weights": None,
        "dst_row": torch.zeros(T, R, **i32),
        "lists": torch.zeros(N, T, **i32),
        "list_count": torch.zeros(C, N, **i32),
        "plan": torch.zeros(N, 3, L, **i32),
        "recv_rows": torch.zeros(L, **i32),
        "recv_prefix": torch.zeros(R + 1, **i32),
        "recv_x": torch.zeros(rows, H, **bf16),
        "recv_x_scales": None,
        "recv_topk_idx": None,
        "recv_topk_weights": None,
        "recv_src_idx": torch.zeros(rows, **i32),
    }

    def dispatch(verdict=None, **change):
        tensors = InternodeDispatchTensors(**{**d, **change})
        c_in.dispatch_call(ctx, stream, verdict, rings, tensors, False, 2)

    for change, needle in [
        ({"x": None}, "internode dispatch: x is None"),
        ({"dst_row": torch.zeros(T, R, dtype=torch.int64, device=dev)}, "dst_row has dtype int64"),
        (
            {"lists": torch.zeros(N, T + 1, **i32)},
            r"lists has shape \[2, 5\]; expected 2-D with 2 rows and 4",
        ),
        (
            {"plan": torch.zeros(N, 3, **i32)},
            r"plan has shape \[2, 3\]; expected 3-D with shape \[2, any, 1\]",
        ),
        (
            {"recv_x": torch.zeros(rows, H, dtype=torch.float16, device=dev)},
            "recv_x has dtype float16",
        ),
        ({"topk_idx": torch.zeros(T, 2, dtype=torch.int64, device=dev)}, "topk_weights is None"),
        ({"recv_src_idx": None}, "recv_src_idx is None"),
        (
            {"recv_prefix": torch.zeros(R, **i32)},
            r"recv_prefix has shape \[2\]; expected 1-D with 3",
        ),
        (
            {"x": torch.zeros(T, 4, **bf16), "recv_x": torch.zeros(rows, 4, **bf16)},
            "rows of 8 bytes; the kernels move rows in 16-byte vectors",
        ),
        ({"verdict": torch.zeros(2, dtype=torch.int64, device=dev)}, r"verdict has shape \[2\]"),
    ]:
        with pytest.raises(InvalidInputError, match=needle):
            dispatch(**change)

    c = {  # the fields of InternodeCombineTensors
        "x": torch.zeros(rows, H, **bf16),
        "topk_weights": torch.zeros(rows, 2, **f32),
        "bias0": None,
        "bias1": None,
        "out": torch.zeros(T, H, **bf16),
        "out_weights": torch.zeros(T, 2, **f32),
        "recv_count": torch.zeros(1, **i32),
        "plan": torch.zeros(N, 3, L, **i32),
        "lists": torch.zeros(N, 3, **i32),
        "list_count": torch.zeros(C, N, **i32),
        "src_tokens": torch.zeros(N, **i32),
        "dst_row": torch.zeros(T, R, **i32),
        "stream_cum": torch.zeros(T, N, **i32),
    }

    def combine(num_recv=rows, **change):
        tensors = InternodeCombineTensors(**{**c, **change})
        c_in.combine_call(ctx, stream, None, rings, tensors, num_recv)

    for change, needle in [
        ({"out_weights": None}, "internode combine: out_weights is None"),
        ({"bias1": torch.zeros(T, H, **bf16)}, r"bias\[1\] given without bias\[0\]"),
        ({"stream_cum": torch.zeros(T, N + 1, **i32)}, r"stream_cum has shape \[4, 3\]"),
        (
            {"lists": torch.zeros(N, 4, **i32)},
            r"lists has shape \[2, 4\]; expected 2-D with 2 rows and 3",
        ),
        ({"x": torch.zeros(rows, H, **f32)}, "internode combine: out has dtype bfloat16"),
        ({"num_recv": rows + 1}, "num_recv=7 but x has 6 rows"),
    ]:
        with pytest.raises(InvalidInputError, match=needle):
            combine(**change)

    # A context outliving its region raises at the call (its allocations are checked each time).
    _C.device_free(region)
    with pytest.raises(InvalidInputError, match="internode dispatch: region"):
        dispatch()
    with pytest.raises(InvalidInputError, match="internode combine: region"):
        combine()
    assert ctx.barrier_seq == 0  # no barrier was taken
    _C.device_free(nvl)
    c_in.status_free(st)
    del counters
    _context_alive()


def test_dispatch_begin_checks_its_tensors_and_declines_without_launching(arena_ctx):
    # intranode_dispatch_begin (one binding call: arena block, notify and the data kernel)
    # raises a bad tensor naming it, and returns None, having taken no block and launched
    # nothing, when the status word is set, there is no arena, the staging does not hold the
    # rows or the arena is full (the caller then takes the step-by-step path).
    a = arena_ctx

    def begin(arena_core=a.core, rows=8, cached=None, cached_launch=None, **change):
        cached_launch = cached is not None if cached_launch is None else cached_launch
        experts = 0 if cached_launch else 2
        launch = _C.DispatchLaunch(
            num_sms=2,
            experts_per_rank=experts,
            num_experts=2 * experts,
            header=0,
            num_worst_tokens=rows,
            cached=cached_launch,
        )
        inputs = SimpleNamespace(**{**vars(a.inputs), **change})
        return _C.intranode_dispatch_begin(
            a.ctx, launch, _C.DispatchRows.of_bound(rows), a.stream, a.stream, arena_core, inputs,
            cached,
        )  # fmt: skip

    x, w, in_rank = a.inputs.x, a.inputs.topk_weights, a.inputs.is_token_in_rank
    with pytest.raises(InvalidInputError, match="intranode_dispatch: x has dtype int64"):
        begin(x=x.long())
    with pytest.raises(InvalidInputError, match="topk_weights has shape"):
        begin(topk_weights=w[:, :1])
    with pytest.raises(InvalidInputError, match="is_token_in_rank has shape"):
        begin(is_token_in_rank=in_rank[:, :1])
    handle_send_pos = torch.zeros(T, 2, dtype=torch.int32, device="cuda")
    with pytest.raises(InvalidInputError, match="takes no topk_idx"):
        begin(cached=handle_send_pos)
    with pytest.raises(
        InvalidInputError, match=r"DispatchLaunch.cached=true\), and None otherwise"
    ):
        begin(cached_launch=True)  # a cached launch without the handle's send_pos
    assert begin(arena_core=None) is None
    assert begin(rows=1 << 20) is None  # the staging does not hold the rows
    assert begin(rows=(ARENA_BYTES // (H * 2)) + 1) is None  # the block does not fit
    _C.host_status_record(a.st, [1, 0, 0, 0])
    assert begin() is None  # the status word is set: the step-by-step path raises it
    assert a.core.live == 0
