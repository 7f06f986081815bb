"""CPU checks of how a ``kernels``-backend rank that gives up on a call tells its peers, and what
a peer that finds the record raises: the abort record's word (packed as ``abort_word`` of
``csrc/kernels/intranode.h`` packs it), the host's decision to post one (an interrupt or an
error of its own inside a call; not when the kernels already told the peers), and the message
of the late peer, which must name the rank that gave up and the call. The device side (a
kernel wait that times out posts the record, a barrier a late rank passes fails on it) runs
in tests/gpu/test_failure_scenarios.py."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from uccl_ep_megatron import _C
from uccl_ep_megatron.backends.agreement import error_class, error_code
from uccl_ep_megatron.backends.base import DispatchArgs, Topology
from uccl_ep_megatron.backends.intranode.status import (
    ABORT_HOST_GAVE_UP,
    ABORT_PEER_EXITED,
    ABORT_REJECTED,
    ABORT_TIMED_OUT,
    abort_word,
    gave_up_reason,
    peer_abort_error,
    peer_exited_reason,
)
from uccl_ep_megatron.core.config import Config
from uccl_ep_megatron.core.errors import (
    CommTimeoutError,
    InvalidInputError,
    UcclEpError,
    UnsupportedError,
)

NOTIFY_SITE = 1  # kSiteNotify of common.cuh
COMBINE_RECEIVE_SITE = 4


def _fields(word: int) -> dict[str, int]:
    """The word taken apart by hand, from the layout intranode.h documents."""
    return {
        "code": word % 256,
        "kind": word // 256 % 256,
        "site": word // 65536 % 256,
        "peer": word // 2**24 % 256,
        "seq": word // 2**32,
    }


@pytest.mark.parametrize(
    "kind, code, site, peer, seq",
    [
        (ABORT_TIMED_OUT, 0, NOTIFY_SITE, 3, 1),
        (ABORT_REJECTED, 2, 0, 0, 0),
        (3, 0, 6, 7, 2**32 - 1),
    ],
)
def test_abort_word_packs_every_field(kind, code, site, peer, seq):
    word = abort_word(kind, code, site, peer, seq)
    assert _fields(word) == {"code": code, "kind": kind, "site": site, "peer": peer, "seq": seq}
    assert word != 0  # a posted record is never mistaken for none
    if _C.kernels_built():  # the kernels pack it in C++: the two must agree
        assert word == _C.abort_word(kind, code, site, peer, seq)
        assert (
            _C.ABORT_REJECTED,
            _C.ABORT_TIMED_OUT,
            _C.ABORT_HOST_GAVE_UP,
            _C.ABORT_PEER_EXITED,
        ) == (ABORT_REJECTED, ABORT_TIMED_OUT, ABORT_HOST_GAVE_UP, ABORT_PEER_EXITED)


def test_a_late_rank_names_the_rank_that_timed_out_and_its_barrier():
    word = abort_word(ABORT_TIMED_OUT, site=NOTIFY_SITE, peer=1, seq=5)
    err = peer_abort_error(1, 0, word, "", 3000, "this rank's dispatch (dtype=bfloat16)")
    assert isinstance(err, CommTimeoutError), type(err)
    msg = str(err)
    assert msg.startswith("rank 1: this rank's dispatch (dtype=bfloat16) cannot complete"), msg
    assert "rank 0 gave up on the dispatch notify barrier (#5)" in msg, msg
    assert "waiting for this rank" in msg and "UCCL_EP_TIMEOUT_MS=3000" in msg, msg
    assert "rejected its arguments" not in msg and "create a new one" in msg, msg
    # At 3 ranks the rank that gave up may have waited for another one: name that one.
    word = abort_word(ABORT_TIMED_OUT, site=COMBINE_RECEIVE_SITE, peer=2, seq=8)
    msg = str(peer_abort_error(1, 0, word, "", 3000, "this rank's combine"))
    assert "rank 0 gave up on the combine receive barrier (#8)" in msg, msg
    assert "waiting for rank 2" in msg, msg


def test_a_peer_that_gave_up_on_the_host_is_named_with_its_reason():
    reason = gave_up_reason(2, "dispatch", KeyboardInterrupt())
    assert reason == "rank 2 was interrupted (KeyboardInterrupt) in dispatch"
    err = peer_abort_error(0, 2, abort_word(ABORT_HOST_GAVE_UP), reason, 3000, "this rank's x")
    assert type(err) is UcclEpError
    assert str(err).startswith(f"rank 0: this rank's x cannot complete: {reason};"), str(err)
    stuck = CommTimeoutError("rank 2: the notify kernel did not finish; the GPU may need a restart")
    assert gave_up_reason(2, "dispatch", stuck) == (
        "rank 2 gave up on dispatch: the notify kernel did not finish"
    )
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
    assert gave_up_reason(2, "combine", oom) == (
        "rank 2 abandoned combine: OutOfMemoryError: CUDA out of memory"
    )


def test_a_rejected_call_keeps_its_class_and_reason():
    word = abort_word(ABORT_REJECTED, error_code(InvalidInputError("x")))
    err = peer_abort_error(0, 1, word, "dispatch #4: bad topk_idx", 3000, "this rank's dispatch")
    assert type(err) is error_class(error_code(InvalidInputError("x"))) is InvalidInputError
    assert "rank 1 rejected its arguments (dispatch #4: bad topk_idx)" in str(err), str(err)


class _Device:
    """The two ``_C`` calls the host decision makes, on memory the test can read: the status
    word 0 (set by a kernel that failed) and the abort records posted into peers."""

    KERNELS_MAX_LOCAL_EXPERTS = 4096

    def __init__(self, status_word: int = 0) -> None:
        self.status_word = status_word
        self.posted: list[tuple[int, int, str]] = []
        # Records in this rank's own control region: (buffer, peer) -> (word, reason).
        self.own: dict[tuple[int, int], tuple[int, str]] = {}

    def host_status_read(self, status: int) -> tuple[int, int, int, int]:
        return (self.status_word, 0, 0, 0)

    def post_abort(self, buffers: list[int], rank: int, word: int, reason: str) -> None:
        self.posted.append((rank, word, reason))

    def post_abort_as(self, own_buffer: int, peer: int, word: int, reason: str) -> None:
        self.own[own_buffer, peer] = (word, reason)

    def read_abort(self, own_buffer: int, peer: int) -> tuple[int, str]:
        return self.own.get((own_buffer, peer), (0, ""))

    def DispatchLaunch(self, **kwargs):  # noqa: N802 - the binding's name
        raise KeyboardInterrupt  # Ctrl-C while the call prepares its launch


def _backend(device: _Device):
    from uccl_ep_megatron.backends.intranode.backend import KernelsBackend

    be = object.__new__(KernelsBackend)
    be._c = device
    be.topology = Topology(rank=1, num_ranks=2, ranks_per_node=2)
    be._destroyed = False
    be._aborted = None
    be._exited = {}
    be._region_lock = threading.Lock()
    be._watcher = None
    be._last_call = ("no call", None, 0, 0)
    be._status = 0
    be._device_index = -1  # no device to switch to
    be._launches = {}
    be._ipc = type("Ipc", (), {"ptrs": [0x1000, 0x2000]})()
    return be


def _args() -> DispatchArgs:
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    idx = torch.zeros(4, 2, dtype=torch.int64)
    return DispatchArgs(
        x=x,
        x_scales=None,
        topk_idx=idx,
        topk_weights=torch.zeros(4, 2),
        is_token_in_rank=torch.ones(4, 2, dtype=torch.bool),
        num_tokens_per_rank=torch.tensor([4, 4], dtype=torch.int32),
        num_tokens_per_rdma_rank=None,
        num_tokens_per_expert=torch.tensor([4, 4, 0, 0], dtype=torch.int32),
        num_experts=4,
        expert_alignment=1,
        num_worst_tokens=0,
        config=Config(24),
        cached=None,
    )


def test_an_interrupted_dispatch_tells_the_peers_once_and_breaks_the_buffer():
    device = _Device()
    be = _backend(device)
    with pytest.raises(KeyboardInterrupt):
        be.dispatch(_args())
    assert len(device.posted) == 1, device.posted
    rank, word, reason = device.posted[0]
    assert rank == 1 and _fields(word)["kind"] == ABORT_HOST_GAVE_UP, (rank, word)
    assert reason == "rank 1 was interrupted (KeyboardInterrupt) in dispatch", reason
    # This rank's later calls raise at once, saying why; nothing is posted twice.
    with pytest.raises(UcclEpError, match="rank 1 was interrupted .* create a new one"):
        be.dispatch(_args())
    be._give_up("combine", KeyboardInterrupt())
    assert len(device.posted) == 1, device.posted


def test_nothing_is_posted_when_the_kernels_told_the_peers():
    """A kernel wait that timed out posted the record itself (and set the status word): the
    host leaves it there, so the late peer reads the kernel's barrier and sequence."""
    device = _Device(status_word=_C.STATUS_TIMEOUT if _C.kernels_built() else 1)
    be = _backend(device)
    be._give_up("dispatch", KeyboardInterrupt())
    assert device.posted == [] and be._aborted is None


def test_errors_every_rank_raises_alike_are_not_posted():
    """An error of the package (a status word, every rank's checks) is raised by every rank
    alike, or the kernels told the peers: posting a record would break a Buffer that stays
    usable after it."""
    device = _Device()
    be = _backend(device)

    def launch(**kwargs):
        raise UnsupportedError("4096 experts per rank exceed the kernels' limit")

    device.DispatchLaunch = launch
    with pytest.raises(UnsupportedError):
        be.dispatch(dataclasses.replace(_args()))
    assert device.posted == [] and be._aborted is None


def test_a_peer_whose_process_exited_is_named_with_its_pid_and_the_advice():
    reason = peer_exited_reason(3, 4242)
    word = abort_word(ABORT_PEER_EXITED)
    err = peer_abort_error(0, 3, word, reason, 3000, "this rank's dispatch (dtype=bfloat16)")
    assert isinstance(err, CommTimeoutError), type(err)
    msg = str(err)
    assert msg.startswith("rank 0: this rank's dispatch (dtype=bfloat16) cannot complete"), msg
    assert "rank 3's process (pid 4242) exited" in msg, msg
    assert "restart the job" in msg and "UCCL_EP_TIMEOUT_MS=" not in msg, msg


def test_the_watcher_posts_in_the_dead_ranks_name_into_this_ranks_own_region():
    """The liveness watcher's report: an abort record of kind ABORT_PEER_EXITED at the dead
    rank's slot of this rank's own buffer (so this rank's kernels waiting for it stop), and
    every later call raises at once naming it; nothing goes to the peers' regions."""
    device = _Device()
    be = _backend(device)  # rank 1; its own buffer is ptrs[1]
    be._peer_exited(0, 777)
    assert device.posted == []
    assert list(device.own) == [(0x2000, 0)], device.own
    word, reason = device.own[0x2000, 0]
    assert _fields(word)["kind"] == ABORT_PEER_EXITED and reason == peer_exited_reason(0, 777)
    with pytest.raises(CommTimeoutError, match=r"rank 0's process \(pid 777\) exited.*restart"):
        be.dispatch(_args())
    assert device.posted == []  # the dead rank is the cause: this rank tells nobody


def test_a_record_the_dead_rank_posted_itself_is_kept():
    """A rank interrupted before it died told this rank why: that record says more."""
    device = _Device()
    be = _backend(device)
    own = (0x2000, 0)
    device.own[own] = (abort_word(ABORT_HOST_GAVE_UP), "rank 0 was interrupted")
    be._peer_exited(0, 777)
    assert device.own[own] == (abort_word(ABORT_HOST_GAVE_UP), "rank 0 was interrupted")


def test_nothing_is_posted_after_destroy():
    device = _Device()
    be = _backend(device)
    be._destroyed = True
    be._peer_exited(0, 777)
    assert device.own == {} and be._exited == {}
