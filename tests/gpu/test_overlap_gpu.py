"""Megatron's EP overlap schedule (``overlap_moe_expert_parallel_comm``) with ``uccl_ep`` at EP2.

A small MoE GPT (megatron-core's local layer spec: no Transformer Engine) takes one training
step of 4 micro-batches twice, with the same weights and data: once with the overlap off
(Megatron's plain no-pipelining schedule) and once with it on (the combined 1F1B schedule:
each layer split into attention / dispatch / experts / combine nodes, dispatch and combine on
Megatron's communication stream beside the other micro-batch's compute). The per-micro-batch
losses and every parameter gradient must agree within bf16 tolerance, and the overlap must have
run: the step went through ``build_schedule_plan``, and every ``Buffer`` call of the overlapped
step was asynchronous (``async_finish`` with a ``previous_event``) and made from Megatron's
communication stream, while every call of the plain step was synchronous from the default one.

Where megatron-core's ``flex`` dispatcher overlaps the shared expert (0.19+), a model with a
shared expert takes the same step with ``moe_shared_expert_overlap`` off and on (the plain
schedule both times): the dispatcher must run the shared expert's split forward (losses and
gradients as without the overlap, so its output was added once).

Runs on each available ``Buffer`` backend (``kernels`` when built, ``reference``); needs 2 GPUs.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import kernels_built  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.megatron,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (EP2 over NCCL)"),
]
HERE = os.path.abspath(__file__)
WORLD = 2
SEQ, MICRO_BATCH, MICRO_BATCHES, VOCAB = 128, 2, 4, 1024


# (off, on) config changes of each case.
SHARED = {"moe_shared_expert_intermediate_size": 256}
CASES = {
    "ep": ({}, {"overlap_moe_expert_parallel_comm": True}),
    "shared": (SHARED, {**SHARED, "moe_shared_expert_overlap": True}),
}


def _config(world: int, extra: dict):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2,
        hidden_size=256,
        num_attention_heads=4,
        ffn_hidden_size=512,
        num_moe_experts=4 * world,
        moe_router_topk=2,
        moe_ffn_hidden_size=256,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="uccl_ep",
        expert_model_parallel_size=world,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        **extra,
    )


def _model(config):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return (
        GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            position_embedding_type="rope",
        )
        .cuda()
        .bfloat16()
    )  # as Megatron's Float16Module casts a bf16 model's parameters


def _batches(rank: int) -> list[dict[str, torch.Tensor]]:
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device="cuda"), diagonal=1)
    out = []
    for k in range(MICRO_BATCHES):
        g = torch.Generator(device="cuda").manual_seed(1000 * rank + k)
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g, device="cuda")
        out.append(
            {
                "tokens": tokens[:, :-1].contiguous(),
                "labels": tokens[:, 1:].contiguous(),
                "loss_mask": torch.ones(MICRO_BATCH, SEQ, device="cuda"),
                "position_ids": torch.arange(SEQ, device="cuda").expand(MICRO_BATCH, -1),
                "attention_mask": mask[None, None],
            }
        )
    return out


def _loss(loss_mask: torch.Tensor, output: torch.Tensor):
    loss = (output.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach()}


def _forward_step(plans: list[int], data_iterator, model, return_schedule_plan: bool = False):
    """Megatron-LM's ``forward_step`` shape; the combined 1F1B schedule asks for a plan."""
    b = next(data_iterator)
    args = (b["tokens"], b["position_ids"], b["attention_mask"])
    kwargs = {"labels": b["labels"], "loss_mask": b["loss_mask"]}
    loss = functools.partial(_loss, b["loss_mask"])
    if return_schedule_plan:
        plans.append(1)
        return model.build_schedule_plan(*args, **kwargs), loss
    return model(*args, **kwargs), loss


def _spy_buffer(calls: list[tuple[str, bool, bool, str]]):
    """Record (method, async_finish, previous_event given, caller's stream) of every Buffer
    call (the calls still run); returns the undo."""
    from megatron.core.pipeline_parallel import utils as pp_utils

    from uccl_ep_megatron.api.buffer import Buffer

    def stream_name() -> str:
        current = torch.cuda.current_stream()
        if current == pp_utils.get_comm_stream():
            return "megatron-comm"
        return "default" if current == torch.cuda.default_stream() else "other"

    saved = {}
    for name in ("get_dispatch_layout", "dispatch", "combine"):
        original = saved[name] = getattr(Buffer, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            calls.append(
                (
                    _name,
                    bool(kwargs.get("async_finish", False)),
                    kwargs.get("previous_event") is not None,
                    stream_name(),
                )
            )
            return _original(self, *args, **kwargs)

        setattr(Buffer, name, spy)
    return lambda: [setattr(Buffer, n, f) for n, f in saved.items()]


def _step(model, rank: int) -> dict:
    """One forward/backward over the micro-batches: losses, grads, plans and Buffer calls."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    plans: list[int] = []
    calls: list[tuple[str, bool, bool, str]] = []
    undo = _spy_buffer(calls)
    try:
        reduced = get_forward_backward_func()(
            forward_step_func=functools.partial(_forward_step, plans),
            data_iterator=iter(_batches(rank)),
            model=[model],
            num_microbatches=MICRO_BATCHES,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            decoder_seq_length=SEQ,
            forward_only=False,
        )
        torch.cuda.synchronize()
    finally:
        undo()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {
        "losses": [float(r["lm loss"]) for r in reduced],
        "grads": grads,
        "plans": len(plans),
        "calls": calls,
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def w_overlap_on_off(rank, world, backend, case):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from uccl_ep_megatron.token_dispatcher import UcclEpTokenDispatcher

    from uccl_ep_megatron import megatron_plugin

    megatron_plugin.install(backend=backend)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(1234)
    try:
        off_config, on_config = CASES[case]
        plain = _model(_config(world, off_config))
        overlapped = _model(_config(world, on_config))
        overlapped.load_state_dict(plain.state_dict())
        moe = overlapped.decoder.layers[0].mlp
        d = moe.token_dispatcher
        assert isinstance(d, UcclEpTokenDispatcher)
        assert d.overlap == (case == "ep")
        assert (d.shared_experts is not None) == (case == "shared")
        assert d.shared_experts is None or d.shared_experts is moe.shared_experts
        off, on = _step(plain, rank), _step(overlapped, rank)
        assert off["grads"].keys() == on["grads"].keys() and off["grads"]
        worst = max(((_rel(on["grads"][n], g), n) for n, g in off["grads"].items()))
        return {
            "backend": d.buffer.backend,
            "losses_off": off["losses"],
            "losses_on": on["losses"],
            "worst_grad": worst,
            "plans": (off["plans"], on["plans"]),
            "calls_off": sorted(set(off["calls"])),
            "calls_on": sorted(set(on["calls"])),
            "num_calls": (len(off["calls"]), len(on["calls"])),
        }
    finally:
        megatron_plugin.buffer_cache().clear()
        ps.destroy_model_parallel()
        megatron_plugin.uninstall()


def _check(r: dict, backend: str, case: str) -> None:
    assert r["backend"] == backend, r
    plans = MICRO_BATCHES if case == "ep" else 0
    assert r["plans"] == (0, plans), "the combined 1F1B schedule ran where it should not, or not"
    for off, on in zip(r["losses_off"], r["losses_on"], strict=True):
        # bf16 tolerance (eps 2^-8): the same kernels on the same data, in another order.
        assert abs(on - off) <= 2e-3 * max(1.0, abs(off)), r
    assert r["worst_grad"][0] < 2e-2, r
    # 2 layers x 4 micro-batches x (layout, dispatch, combine; backward: combine, dispatch).
    assert r["num_calls"] == (40, 40), r
    assert {(a, e, s) for _, a, e, s in r["calls_off"]} == {(False, False, "default")}, r
    on = {(True, True, "megatron-comm")} if case == "ep" else {(False, False, "default")}
    assert {(a, e, s) for _, a, e, s in r["calls_on"]} == on, r


def _run(backend: str, case: str) -> None:
    pytest.importorskip("megatron.core")
    if backend == "kernels" and not kernels_built():
        pytest.skip("_C was built without a GPU toolchain: no kernels backend")
    from dist_utils import DistPool

    pool = DistPool(WORLD, gpus=torch.cuda.device_count())
    try:
        reports = pool.run(HERE, "w_overlap_on_off", backend, case)
    finally:
        pool.close()
    line = json.dumps({"backend": backend, "case": case, "ranks": reports})
    print(line)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, f"overlap_gpu_{case}_{backend}.json"), "w") as f:
            f.write(line)
    for r in reports:
        _check(r, backend, case)


@pytest.mark.parametrize("backend", ["reference", "kernels"])
def test_overlap_schedule_losses_equal_the_plain_schedule(backend):
    _run(backend, "ep")


@pytest.mark.parametrize("backend", ["reference", "kernels"])
def test_shared_expert_overlap_losses_equal_the_plain_shared_expert(backend):
    pytest.importorskip("megatron.core")
    from uccl_ep_megatron.token_dispatcher.dispatcher import flex_overlaps_shared_experts

    if not flex_overlaps_shared_experts():
        pytest.skip("this megatron-core's flex dispatcher does not overlap the shared expert")
    _run(backend, "shared")
