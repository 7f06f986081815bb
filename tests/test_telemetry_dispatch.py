"""The one dispatch/combine recorder: one record per call, host time beside device time."""

from __future__ import annotations

import time

import pytest
import torch

from uccl_ep_megatron.telemetry import dispatch as dm


class _SelfTimingDispatcher:
    """Records itself through the recorder, as the uccl_ep dispatcher does."""

    layer_number = 3

    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s
        self.fail = False

    def token_dispatch(self, hidden_states, probs):
        timer = dm.recorder.start(hidden_states.device)
        time.sleep(self.sleep_s)
        if self.fail:
            raise RuntimeError("boom")
        out = torch.cat([hidden_states, hidden_states])
        dm.recorder.record(timer, self.layer_number, "dispatch", 1)  # a wrong byte count
        return out, probs

    def token_combine(self, hidden_states):
        timer = dm.recorder.start(hidden_states.device)
        time.sleep(self.sleep_s)
        dm.recorder.record(timer, self.layer_number, "combine", 1)
        return hidden_states[: hidden_states.shape[0] // 2]


@pytest.fixture
def recorder_on():
    dm.collect()
    dm.enable(True)
    yield
    dm.enable(False)
    dm.collect()


def test_instrumented_call_is_recorded_once_with_host_time(recorder_on):
    d = _SelfTimingDispatcher(0.02)
    dm.instrument(d, d.layer_number)
    x = torch.ones(4, 8, dtype=torch.bfloat16)
    for _ in range(2):
        y, _ = d.token_dispatch(x, probs=None)
        d.token_combine(y)
    step = dm.collect()
    m = step.layers[3]
    # The dispatcher's own records inside the instrumented calls are skipped: one per call,
    # with the bytes the hook measured (received rows), not the dispatcher's.
    assert m.calls == 2
    assert m.dispatch_bytes == 2 * 8 * 8 * 2 and m.combine_bytes == 2 * 8 * 8 * 2
    assert m.dispatch_host_ms >= 2 * 20 and m.combine_host_ms >= 2 * 20
    # No device on the CPU: the device column holds the same wall time.
    assert m.dispatch_ms == m.dispatch_host_ms and m.combine_ms == m.combine_host_ms
    s = step.summary()
    assert s["dispatch_host_ms"] == m.dispatch_host_ms and s["combine_time_ms"] == m.combine_ms
    assert step.per_layer()["layer3/combine_host_ms"] == m.combine_host_ms


def test_uninstrumented_dispatcher_still_records_itself(recorder_on):
    d = _SelfTimingDispatcher(0.0)
    y, _ = d.token_dispatch(torch.ones(2, 4), probs=None)
    d.token_combine(y)
    m = dm.collect().layers[3]
    assert m.calls == 1 and m.dispatch_bytes == 1 and m.combine_bytes == 1


def test_failed_call_records_nothing_and_releases_the_call(recorder_on):
    d = _SelfTimingDispatcher(0.0)
    dm.instrument(d, 5)
    d.fail = True
    with pytest.raises(RuntimeError, match="boom"):
        d.token_dispatch(torch.ones(2, 4), probs=None)
    assert dm.collect().layers == {}
    d.fail = False
    d.token_dispatch(torch.ones(2, 4), probs=None)
    assert dm.collect().layers[5].calls == 1


def test_disabled_recorder_records_nothing():
    dm.enable(False)
    d = _SelfTimingDispatcher(0.0)
    dm.instrument(d, 1)
    d.token_dispatch(torch.ones(2, 4), probs=None)
    assert dm.collect().layers == {}


def test_timed_rejects_an_unknown_kind(recorder_on):
    with pytest.raises(ValueError, match="kind='route': must be one of dispatch, combine"):
        with dm.recorder.timed(torch.device("cpu"), 0, "route"):
            pass


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a stand-in for the rows' trip back."""

    @staticmethod
    def forward(ctx, t, sleep_s):
        ctx.sleep_s = sleep_s
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.sleep_s)
        return grad, None


class _AutogradDispatcher:
    """A dispatcher whose calls have backwards: dispatch duplicates the rows (its backward sums
    the two copies, after ``dispatch_back_s``), combine keeps the first half."""

    def __init__(self, dispatch_back_s: float = 0.0) -> None:
        self.dispatch_back_s = dispatch_back_s

    def token_dispatch(self, hidden_states, probs):
        x = _SlowBackward.apply(hidden_states, self.dispatch_back_s)
        return torch.cat([x, x]), probs

    def token_combine(self, hidden_states):
        return hidden_states[: hidden_states.shape[0] // 2] * 1.0


def _step(d, x, w):
    y, _ = d.token_dispatch(x, probs=None)
    out = d.token_combine(y * w)
    (out * out).sum().backward()


def test_backward_of_each_call_is_timed_and_gradients_are_unchanged(recorder_on):
    w = torch.arange(1.0, 9.0)
    x0 = torch.randn(4, 8)
    plain = _AutogradDispatcher()
    x_ref = x0.clone().requires_grad_()
    _step(plain, x_ref, w)
    dm.collect()
    d = _AutogradDispatcher(dispatch_back_s=0.03)
    dm.instrument(d, 7)
    x = x0.clone().requires_grad_()
    for _ in range(2):
        x.grad = None
        _step(d, x, w)
    # The marks are identities: the gradient is the uninstrumented one, bit for bit.
    assert torch.equal(x.grad, x_ref.grad)
    step = dm.collect()
    m = step.layers[7]
    assert m.calls == 2 and m.backward_calls == 4
    # The dispatch's backward holds the sleep; the combine's does not (CPU: wall time).
    assert m.dispatch_backward_ms >= 2 * 30
    assert m.combine_backward_ms < 20
    s = step.summary()
    assert s["dispatch_backward_time_ms"] == m.dispatch_backward_ms
    assert s["combine_backward_time_ms"] == m.combine_backward_ms
    assert step.per_layer()["layer7/dispatch_backward_time_ms"] == m.dispatch_backward_ms


def test_calls_without_a_gradient_have_no_backward_columns(recorder_on):
    d = _AutogradDispatcher()
    dm.instrument(d, 2)
    y, _ = d.token_dispatch(torch.randn(4, 8), probs=None)
    d.token_combine(y)
    with torch.no_grad():
        y, _ = d.token_dispatch(torch.randn(4, 8, requires_grad=True), probs=None)
        d.token_combine(y)
    step = dm.collect()
    assert step.layers[2].calls == 2 and step.layers[2].backward_calls == 0
    assert "dispatch_backward_time_ms" not in step.summary()


def test_a_call_by_keyword_is_marked_and_timed_backward(recorder_on):
    d = _AutogradDispatcher(dispatch_back_s=0.01)
    dm.instrument(d, 4)
    x = torch.randn(2, 8, requires_grad=True)
    y, _ = d.token_dispatch(hidden_states=x, probs=None)
    out = d.token_combine(hidden_states=y)
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # combine keeps the first copy
    m = dm.collect().layers[4]
    assert m.backward_calls == 2 and m.dispatch_backward_ms >= 10


class _PermutingDispatcher(_AutogradDispatcher):
    """With megatron-core's methods around the exchange: ``dispatch_preprocess`` permutes (its
    backward sleeps ``pre_back_s``), ``dispatch_postprocess`` sleeps ``post_s`` forward."""

    def __init__(self, pre_back_s: float = 0.0, post_s: float = 0.0) -> None:
        super().__init__()
        self.pre_back_s, self.post_s = pre_back_s, post_s

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        return _SlowBackward.apply(hidden_states.flip(0), self.pre_back_s), probs

    def dispatch_postprocess(self, hidden_states, probs):
        time.sleep(self.post_s)
        return hidden_states.flip(0), None, probs

    def combine_preprocess(self, hidden_states):
        return hidden_states * 2.0

    def combine_postprocess(self, hidden_states):
        return hidden_states.flip(0)


def _layer_step(d, x, w, router_back_s):
    """A layer's step: a router branch on the same input, whose backward sleeps, beside the
    dispatcher's six calls."""
    scores = _SlowBackward.apply(x, router_back_s)
    h, _ = d.dispatch_preprocess(x, None, None)
    y, _ = d.token_dispatch(h, probs=None)
    e, _, _ = d.dispatch_postprocess(y, None)
    out = d.combine_postprocess(d.token_combine(d.combine_preprocess(e * w)))
    ((out * out).sum() + scores.sum()).backward()


def test_the_dispatchers_permutation_is_timed_apart_forward_and_backward(recorder_on):
    w = torch.arange(1.0, 9.0)
    x0 = torch.randn(4, 8)
    x_ref = x0.clone().requires_grad_()
    _layer_step(_PermutingDispatcher(), x_ref, w, 0.0)
    dm.collect()
    d = _PermutingDispatcher(pre_back_s=0.02, post_s=0.03)
    dm.instrument(d, 9)
    x = x0.clone().requires_grad_()
    _layer_step(d, x, w, router_back_s=0.2)
    assert torch.equal(x.grad, x_ref.grad)
    step = dm.collect()
    m = step.layers[9]
    # Forward: the four methods, with the post-processing's sleep; the exchange apart.
    assert m.calls == 1 and m.permute_calls == 4 + 4
    assert 30 <= m.permute_ms < 150 and m.dispatch_ms < 30
    # Backward: the permutation's sleep, not the router's on the same input (its gradient
    # comes after the router's backward); the exchange's two backwards apart.
    assert 20 <= m.permute_backward_ms < 150
    assert m.backward_calls == 2
    s = step.summary()
    assert s["permute_time_ms"] == m.permute_ms
    assert s["permute_backward_time_ms"] == m.permute_backward_ms
    assert step.per_layer()["layer9/permute_backward_time_ms"] == m.permute_backward_ms


def test_a_dispatcher_without_the_methods_has_no_permutation_columns(recorder_on):
    d = _AutogradDispatcher()
    dm.instrument(d, 1)
    x = torch.randn(4, 8, requires_grad=True)
    _step(d, x, torch.ones(8))
    s = dm.collect().summary()
    assert "dispatch_backward_time_ms" in s and "permute_time_ms" not in s
