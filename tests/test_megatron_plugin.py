"""The ``uccl_ep`` plugin against the installed megatron-core (CI runs every minor 0.14-0.19).

* the version policy: tested releases pass, newer ones warn, older ones are refused, and a
  failed ``install()`` leaves nothing patched;
* the flag parses the way Megatron-LM defines it (0.14/0.15: hard-coded ``choices``; 0.16:
  ``Literal`` field type), with the dispatcher's own flags next to it;
* ``MoELayer`` builds ``UcclEpTokenDispatcher`` (construction works on CPU), and the layer's
  own experts run on what our dispatcher hands them, matching a reference that routes the
  same tokens through the same experts without any dispatcher (forward and weight grads);
* ``python -m uccl_ep_megatron.run`` runs unmodified scripts, also under ``torchrun -m``;
* the opt-in ``deep_ep`` drop-in runs Megatron's own DeepEP path (``fused_a2a``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytestmark = pytest.mark.megatron

from conftest import get_pool  # noqa: E402

HERE = os.path.abspath(__file__)
SCRIPTS = os.path.join(os.path.dirname(HERE), "megatron_scripts")


@pytest.fixture
def argparse_plugin(monkeypatch):
    """The plugin as installed where Megatron-LM's training package is absent: a parser that
    defines ``--moe-token-dispatcher-type`` gets the flags through the wrapped argparse (with
    the package present, its ``parse_args`` gets them instead: tested further down and in
    test_megatron_lm_entry.py)."""
    from uccl_ep_megatron.token_dispatcher import reset_options

    from uccl_ep_megatron import megatron_plugin
    from uccl_ep_megatron.megatron_plugin import arguments

    monkeypatch.setattr(arguments, "_megatron_lm_present", lambda: False)
    megatron_plugin.install()
    yield megatron_plugin
    megatron_plugin.uninstall()
    reset_options()


# The stand-in scripts build their own parsers, which only the argparse fallback serves.
needs_argparse_fallback = pytest.mark.skipif(
    importlib.util.find_spec("megatron.training") is not None,
    reason="Megatron-LM's training package is installed: the plugin serves its parse_args, "
    "not other parsers (test_megatron_lm_entry.py runs the real one)",
)


def _run(cmd: list[str], timeout: int = 240, **env_extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("UCCL_EP_BACKEND", None)
    env.update(env_extra)
    # A neutral working directory: `python -m` puts it first on sys.path, and the repo root
    # holds the uninstalled source tree (without token_dispatcher inside the package).
    with tempfile.TemporaryDirectory() as cwd:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
        )


# ---- version ---------------------------------------------------------------------------------
def test_version_policy():
    import warnings

    from uccl_ep_megatron.core.errors import UnsupportedError
    from uccl_ep_megatron.megatron_plugin import (
        TESTED_VERSIONS,
        UntestedVersionWarning,
        check_version,
    )

    assert TESTED_VERSIONS == ("0.14", "0.15", "0.16", "0.17", "0.18", "0.19", "0.20")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a tested release must not warn
        for version in ("0.14.0", "0.15.3", "0.16.1rc0", "0.17.1", "0.18.2", "0.19.2", "0.20.0"):
            assert check_version(version) == version[:4]
    for newer in ("0.21.0", "0.21.0rc0.dev1", "1.0.0"):
        with pytest.warns(UntestedVersionWarning, match=re.escape(newer)):
            assert check_version(newer) == ".".join(newer.split(".")[:2])
    for bad in ("0.13.1", "0.9.0"):
        with pytest.raises(UnsupportedError) as exc:
            check_version(bad)
        assert bad in str(exc.value)
        assert all(v in str(exc.value) for v in TESTED_VERSIONS)
    with pytest.raises(UnsupportedError, match="MAJOR.MINOR"):
        check_version("unknown")


def _snapshot():
    from uccl_ep_megatron.token_dispatcher import get_options

    from uccl_ep_megatron import megatron_plugin

    env = {k: os.environ.get(k) for k in ("UCCL_EP_NUM_PROXY_THREADS", "UCCL_EP_TRANSPORT")}
    return (
        argparse._ActionsContainer.add_argument,
        get_options(),
        env,
        megatron_plugin.is_installed(),
    )


def test_install_refuses_older_megatron_and_changes_nothing(monkeypatch):
    from megatron.core import package_info

    from uccl_ep_megatron import megatron_plugin
    from uccl_ep_megatron.core.errors import UnsupportedError

    megatron_plugin.uninstall()
    before = _snapshot()
    monkeypatch.setattr(package_info, "__version__", "0.12.3")
    with pytest.raises(UnsupportedError, match=r"0\.12\.3.*tested: 0\.14, 0\.15"):
        megatron_plugin.install(num_sms=16, num_proxy_threads=3, transport="ipc")
    assert _snapshot() == before


def test_install_tries_a_newer_megatron_with_a_warning(monkeypatch):
    from megatron.core import package_info

    from uccl_ep_megatron import megatron_plugin
    from uccl_ep_megatron.megatron_plugin import UntestedVersionWarning

    megatron_plugin.uninstall()
    monkeypatch.setattr(package_info, "__version__", "0.21.0rc1")
    try:
        with pytest.warns(UntestedVersionWarning, match="0.21.0rc1"):
            assert megatron_plugin.install() == "0.21.0rc1"
        assert megatron_plugin.is_installed()
    finally:
        megatron_plugin.uninstall()


def test_missing_api_fails_clearly_and_restores_everything(monkeypatch):
    from megatron.core.transformer.moe import moe_layer

    from uccl_ep_megatron import megatron_plugin
    from uccl_ep_megatron.core.errors import UnsupportedError

    megatron_plugin.uninstall()
    before = _snapshot()
    monkeypatch.delattr(moe_layer, "MoEFlexTokenDispatcher")
    with pytest.raises(UnsupportedError, match="moe_layer.MoEFlexTokenDispatcher"):
        megatron_plugin.install(num_sms=16, num_proxy_threads=3, transport="ipc")
    assert _snapshot() == before


def test_failure_midway_undoes_the_patches_already_made(monkeypatch):
    """A patch step that raises after others succeeded: every earlier patch is reversed."""
    import dataclasses

    from megatron.core.transformer.moe import moe_layer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from uccl_ep_megatron import megatron_plugin

    def field_type():
        return {f.name: f for f in dataclasses.fields(TransformerConfig)}[
            "moe_token_dispatcher_type"
        ].type

    def broken(*_args):
        raise RuntimeError("injected failure in _patch_moe_layer")

    megatron_plugin.uninstall()
    before = _snapshot()
    before_type, before_init = field_type(), moe_layer.MoELayer.__init__
    monkeypatch.setattr(megatron_plugin, "_patch_moe_layer", broken)
    with pytest.raises(RuntimeError, match="injected"):
        megatron_plugin.install(num_sms=16, transport="ipc")
    assert _snapshot() == before
    assert field_type() == before_type and moe_layer.MoELayer.__init__ is before_init


def test_failed_install_removes_the_deep_ep_module_it_added():
    # A fresh process in which megatron cannot be imported: install() fails after the deep_ep
    # drop-in went in, and must take it out again.
    code = (
        "import sys\n"
        "sys.modules['megatron'] = None\n"
        "from uccl_ep_megatron import megatron_plugin\n"
        "from uccl_ep_megatron.core.errors import UnsupportedError\n"
        "try:\n"
        "    megatron_plugin.install(deep_ep_compat=True)\n"
        "except UnsupportedError as exc:\n"
        "    print('refused:', 'not importable' in str(exc))\n"
        "print('deep_ep left:', 'deep_ep' in sys.modules)\n"
    )
    proc = _run([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr
    assert "refused: True" in proc.stdout and "deep_ep left: False" in proc.stdout


def test_install_reports_the_installed_version(plugin):
    from megatron.core import package_info

    assert plugin.is_installed()
    assert plugin.install() == package_info.__version__  # idempotent


def test_mtp_inference_linear_check_answers_without_transformer_engine(plugin):
    """0.20 without TE: the check MTP layers make must answer (False), not raise; uninstall
    puts megatron-core's own back."""
    mtp = pytest.importorskip("megatron.core.transformer.multi_token_prediction")
    if not hasattr(mtp, "is_inference_column_parallel_linear"):
        pytest.skip("this megatron-core's MTP asks no inference-linear question")
    from megatron.core.tensor_parallel import inference_layers

    assert mtp.is_inference_column_parallel_linear(torch.nn.Linear(2, 2)) is False
    plugin.uninstall()
    original = inference_layers.is_inference_column_parallel_linear
    assert mtp.is_inference_column_parallel_linear is original


def test_router_gemm_runs_without_transformer_engine(plugin):
    """megatron-core 0.16's router GEMM names a TE function even without TE; install fixes it."""
    import inspect

    from megatron.core.transformer.moe import moe_utils

    if getattr(moe_utils, "HAVE_TE", False) or "te_general_gemm" not in inspect.getsource(
        moe_utils
    ):
        pytest.skip("Transformer Engine present, or this version's router GEMM does not use it")
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    if "bias" in inspect.signature(moe_utils.router_gating_linear).parameters:  # 0.15+
        out = moe_utils.router_gating_linear(x, w, None, torch.float32)
    else:
        out = moe_utils.router_gating_linear(x, w, torch.float32)
    torch.testing.assert_close(out, x @ w.t())
    out.sum().backward()
    torch.testing.assert_close(w.grad, x.detach().sum(0).expand(4, 8))


# ---- flag ------------------------------------------------------------------------------------
def _megatron_lm_014_parser() -> argparse.ArgumentParser:
    sys.path.insert(0, SCRIPTS)
    try:
        from megatron_lm_014 import parser_014
    finally:
        sys.path.remove(SCRIPTS)
    return parser_014()[0]


def test_hardcoded_choices_accept_uccl_ep_and_options(argparse_plugin):
    from uccl_ep_megatron.token_dispatcher import get_options

    args = _megatron_lm_014_parser().parse_args(
        [
            "--moe-token-dispatcher-type",
            "uccl_ep",
            "--moe-uccl-ep-num-sms",
            "16",
            "--moe-uccl-ep-backend",
            "reference",
            "--moe-uccl-ep-metrics",
        ]
    )
    assert args.moe_token_dispatcher_type == "uccl_ep"
    assert args.moe_uccl_ep_num_sms == 16
    opts = get_options()
    assert (opts.num_sms, opts.backend, opts.metrics) == (16, "reference", True)


def test_bad_values_still_fail_to_parse(argparse_plugin, capsys):
    parser = _megatron_lm_014_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-token-dispatcher-type", "nccl_magic"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-uccl-ep-num-sms", "7"])
    assert "positive even" in capsys.readouterr().err


def test_without_install_the_flag_is_rejected():
    from uccl_ep_megatron import megatron_plugin

    megatron_plugin.uninstall()
    with pytest.raises(SystemExit):
        _megatron_lm_014_parser().parse_args(["--moe-token-dispatcher-type", "uccl_ep"])


def test_config_field_accepts_uccl_ep(plugin):
    import dataclasses
    import typing

    from megatron.core.transformer.transformer_config import TransformerConfig

    field = {f.name: f for f in dataclasses.fields(TransformerConfig)}["moe_token_dispatcher_type"]
    if typing.get_origin(field.type) is typing.Literal:  # 0.16+: choices come from here
        assert {"allgather", "alltoall", "flex", "uccl_ep"} <= set(typing.get_args(field.type))
    else:  # 0.14/0.15: a plain str field
        assert field.type in (str, "str")
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=1,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=8,
        add_bias_linear=False,
        moe_token_dispatcher_type="uccl_ep",
    )
    assert cfg.moe_token_dispatcher_type == "uccl_ep"


# ---- MoELayer --------------------------------------------------------------------------------
def _moe_layer(config_kwargs, grouped=False):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        **{
            "num_layers": 1,
            "hidden_size": 16,
            "num_attention_heads": 1,
            "num_moe_experts": 4,
            "moe_router_topk": 2,
            "moe_ffn_hidden_size": 8,
            "add_bias_linear": False,
            "use_cpu_initialization": True,
            "moe_router_dtype": "fp32",
            **config_kwargs,
        }
    )
    experts = ModuleSpec(
        module=SequentialMLP,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )
    if grouped:
        from uccl_ep_megatron.token_dispatcher.grouped_experts import experts_spec

        experts = experts_spec()
    return MoELayer(cfg, MoESubmodules(experts=experts), layer_number=3), cfg


def w_moe_layer_runs_experts_on_our_dispatch(rank, world):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: F401
    from uccl_ep_megatron.token_dispatcher import UcclEpTokenDispatcher, reset_options

    from uccl_ep_megatron import megatron_plugin

    megatron_plugin.install(backend="reference")
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    try:
        torch.manual_seed(100 + rank)  # different experts per rank
        layer, cfg = _moe_layer(
            {"moe_token_dispatcher_type": "uccl_ep", "num_moe_experts": 2 * world}
        )
        d = layer.token_dispatcher
        assert isinstance(d, UcclEpTokenDispatcher), type(d)
        assert cfg.moe_token_dispatcher_type == "uccl_ep", "config must be left as it was"
        assert d.layer_number == 3
        assert d.device_counts is False, "SequentialMLP reads its counts on the host"
        layer.set_layer_number(7)
        assert d.layer_number == 7

        num_experts, local = cfg.num_moe_experts, cfg.num_moe_experts // world
        tokens, hidden = 6, cfg.hidden_size

        def inputs(r):
            g = torch.Generator().manual_seed(r)
            x = torch.randn(tokens, 1, hidden, generator=g)
            top = torch.rand(tokens, num_experts, generator=g).topk(2, dim=-1).indices
            rm = torch.zeros(tokens, num_experts, dtype=torch.bool).scatter_(1, top, True)
            p = torch.rand(tokens, num_experts, generator=g) * rm
            return x, rm, p

        x, rm, p = inputs(rank)
        x.requires_grad_(True)
        h, tp_ = d.dispatch_preprocess(x, rm, p)
        rx, rp = d.token_dispatch(h, tp_)
        rows, tpe, pp = d.dispatch_postprocess(rx, rp)
        out, bias = layer.experts(rows, tpe, pp)
        assert bias is None
        y = d.combine_postprocess(d.token_combine(d.combine_preprocess(out)))
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(50 + rank))
        (y * gy).sum().backward()
        ours = [w.grad.clone() for w in layer.experts.parameters()]
        layer.experts.zero_grad()

        # Reference without any dispatcher: this rank's experts on every rank's tokens.
        contrib = torch.zeros(world, tokens, hidden)
        loss = 0.0
        all_in = [inputs(r) for r in range(world)]
        for le in range(local):
            e = rank * local + le
            for r, (xr, rmr, pr) in enumerate(all_in):
                sel = rmr[:, e].nonzero().flatten()
                if sel.numel() == 0:
                    continue
                o, _ = layer.experts.local_experts[le](xr.reshape(tokens, hidden)[sel], pr[sel, e])
                contrib[r].index_add_(0, sel, o.detach())
                gr = torch.randn(tokens, 1, hidden, generator=torch.Generator().manual_seed(50 + r))
                loss = loss + (o * gr.reshape(tokens, hidden)[sel]).sum()
        dist.all_reduce(contrib)
        torch.testing.assert_close(
            y.detach().reshape(tokens, hidden), contrib[rank], atol=1e-5, rtol=1e-5
        )
        loss.backward()
        for a, b in zip(ours, (w.grad for w in layer.experts.parameters()), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert x.grad is not None and torch.isfinite(x.grad).all()

        # Grouped experts take their counts on the GPU: the dispatcher is told so.
        grouped, _ = _moe_layer(
            {
                "moe_token_dispatcher_type": "uccl_ep",
                "num_moe_experts": 2 * world,
                "params_dtype": torch.bfloat16,
                "bf16": True,
            },
            grouped=True,
        )
        assert grouped.token_dispatcher.device_counts is True
    finally:
        ps.destroy_model_parallel()
        megatron_plugin.uninstall()
        reset_options()
        megatron_plugin.buffer_cache().clear()


def test_moe_layer_builds_uccl_ep_and_its_experts_match_reference():
    get_pool(2).run(HERE, "w_moe_layer_runs_experts_on_our_dispatch")


def test_other_dispatcher_types_are_untouched(plugin):
    from megatron.core.transformer.moe import moe_layer

    assert moe_layer.MoEFlexTokenDispatcher.__name__ == "MoEFlexTokenDispatcher"
    get_pool(2).run(HERE, "w_allgather_untouched")


def w_allgather_untouched(rank, world):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from uccl_ep_megatron import megatron_plugin

    megatron_plugin.install()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    try:
        layer, _ = _moe_layer({"moe_token_dispatcher_type": "allgather"})
        assert type(layer.token_dispatcher) is MoEAllGatherTokenDispatcher
    finally:
        ps.destroy_model_parallel()
        megatron_plugin.uninstall()


# ---- run entry point and DeepEP drop-in ------------------------------------------------------
def _run_script(script: str, *flags: str) -> dict:
    """``python -m uccl_ep_megatron.run script --moe-token-dispatcher-type uccl_ep *flags``;
    the JSON the script printed last."""
    proc = _run(
        [
            sys.executable,
            "-m",
            "uccl_ep_megatron.run",
            script,
            "--moe-token-dispatcher-type",
            "uccl_ep",
            *flags,
        ]
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_argparse_fallback
def test_run_entry_point_runs_megatron_lm_014_style_script():
    script = os.path.join(SCRIPTS, "parse_args_014.py")
    seen = _run_script(script, "--moe-uccl-ep-num-sms", "20", "--moe-uccl-ep-backend", "reference")
    assert seen == {
        "name": "__main__",
        "argv0": script,
        "dispatcher": "uccl_ep",
        "num_sms": 20,
        "options_num_sms": 20,
        "options_backend": "reference",
    }


@needs_argparse_fallback
def test_run_entry_point_runs_megatron_lm_016_style_script():
    import dataclasses
    import typing

    from megatron.core.transformer.transformer_config import TransformerConfig

    field = {f.name: f for f in dataclasses.fields(TransformerConfig)}["moe_token_dispatcher_type"]
    script = os.path.join(SCRIPTS, "parse_args_016.py")
    seen = _run_script(script, "--moe-uccl-ep-num-sms", "18", "--moe-uccl-ep-metrics")
    assert seen["dispatcher"] == "uccl_ep"
    # The dispatcher's flags come with the type flag also when its choices need no patching.
    assert seen["num_sms"] == seen["options_num_sms"] == 18 and seen["options_metrics"]
    if typing.get_origin(field.type) is typing.Literal:
        assert "uccl_ep" in seen["choices"]


def test_run_without_a_usable_plugin_still_serves_the_drop_in(tmp_path):
    """--deep-ep-compat needs none of the plugin's hooks: a megatron-core it cannot patch (here:
    none importable at all) is reported and the script runs; without the option it fails."""
    script = tmp_path / "entry.py"
    script.write_text("import deep_ep\nprint('drop-in:', 'uccl_ep_megatron' in deep_ep.__doc__)\n")
    wrapper = (
        "import sys\n"
        "sys.modules['megatron'] = None\n"
        "from uccl_ep_megatron import run\n"
        "run.main(sys.argv[1:])\n"
    )
    proc = _run([sys.executable, "-c", wrapper, "--deep-ep-compat", str(script)])
    assert proc.returncode == 0, proc.stderr
    assert "drop-in: True" in proc.stdout
    assert "uccl_ep is unavailable" in proc.stderr and "not importable" in proc.stderr
    proc = _run([sys.executable, "-c", wrapper, str(script)])
    assert proc.returncode != 0 and "not importable" in proc.stderr


def test_run_entry_point_rejects_missing_script():
    proc = _run([sys.executable, "-m", "uccl_ep_megatron.run", "/nonexistent/pretrain_gpt.py"])
    assert proc.returncode != 0
    assert "does not exist" in proc.stderr


def test_deep_ep_module_is_off_by_default_and_opt_in():
    from uccl_ep_megatron import Buffer, deep_ep_compat
    from uccl_ep_megatron.core.errors import UnsupportedError
    from uccl_ep_megatron.core.events import EventOverlap

    assert not deep_ep_compat.is_installed()
    if "megatron.core.transformer.moe.fused_a2a" in sys.modules:
        # Imported (without DeepEP) by an earlier test: enabling now must refuse clearly.
        with pytest.raises(UnsupportedError, match="before the deep_ep drop-in"):
            deep_ep_compat.install()
        return
    mod = deep_ep_compat.install()
    try:
        import deep_ep
        from deep_ep.utils import EventHandle
        from deep_ep.utils import EventOverlap as EO

        assert mod is deep_ep and deep_ep.Buffer is Buffer and EO is EventOverlap
        assert EO(EventHandle()).event is None  # no CUDA here: nothing to wait for
    finally:
        deep_ep_compat.uninstall()


def test_torchrun_deep_ep_compat_runs_megatron_fused_a2a(tmp_path):
    script = os.path.join(SCRIPTS, "deepep_flex.py")
    proc = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",  # a free rendezvous port: parallel CI jobs cannot collide
            "--nproc-per-node",
            "2",
            "-m",
            "uccl_ep_megatron.run",
            "--deep-ep-compat",
            script,
        ],
        timeout=240,
        RESULT_DIR=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in results] == [0, 1] and all(r["ok"] for r in results)
    assert all(sum(r["tokens_per_expert"]) > 0 for r in results)


# ---- grouped experts through the plugin ------------------------------------------------------
def test_grouped_experts_flag_swaps_local_experts_only(argparse_plugin):
    """``--moe-uccl-ep-grouped-experts`` turns the local spec's experts (SequentialMLP) into
    TorchGroupedMLP for every MoELayer; other expert modules (Transformer Engine's) stay."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from uccl_ep_megatron.token_dispatcher import get_options
    from uccl_ep_megatron.token_dispatcher.grouped_experts import TorchGroupedMLP

    from uccl_ep_megatron.megatron_plugin.model import _with_grouped_experts

    spec = get_moe_module_spec(use_te=False, num_experts=8, moe_grouped_gemm=False)
    sub = spec.submodules if hasattr(spec, "submodules") else spec.keywords["submodules"]
    assert _with_grouped_experts((sub, 1), {}) == ((sub, 1), {})  # off by default
    args = _megatron_lm_014_parser().parse_args(["--moe-uccl-ep-grouped-experts"])
    assert args.moe_uccl_ep_grouped_experts is True and get_options().grouped_experts
    (swapped, number), _ = _with_grouped_experts((sub, 1), {})
    assert swapped.experts.module is TorchGroupedMLP and number == 1
    assert swapped.shared_experts is sub.shared_experts
    assert getattr(sub.experts, "module", getattr(sub.experts, "func", None)) is not TorchGroupedMLP
    _, kwargs = _with_grouped_experts((), {"submodules": sub})
    assert kwargs["submodules"].experts.module is TorchGroupedMLP

    class OtherExperts(torch.nn.Module):  # e.g. TEGroupedMLP: not ours to replace
        pass

    te_like = type(sub)(experts=ModuleSpec(module=OtherExperts), shared_experts=sub.shared_experts)
    assert _with_grouped_experts((te_like,), {}) == ((te_like,), {})


# ---- flags through Megatron-LM's extra_args_provider -------------------------------------------
_FAKE_ARGUMENTS = """
import argparse

def _add_moe_args(parser):
    group = parser.add_argument_group(title="moe")
    group.add_argument("--moe-token-dispatcher-type", type=str,
                       choices=["allgather", "alltoall", "flex"], default="allgather")
    return parser

def parse_args(extra_args_provider=None, ignore_unknown_args=False, argv=None):
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser = _add_moe_args(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser.parse_args(argv)
"""


def test_megatron_lm_parse_args_gets_the_flags_through_extra_args_provider(tmp_path, monkeypatch):
    """Where Megatron-LM's training package exists, ``install()`` leaves argparse alone and
    chains ``add_arguments`` into ``megatron.training.arguments.parse_args`` when that module
    is imported (a stand-in package with Megatron-LM 0.14's hard-coded choices here), after a
    provider of the caller's own; ``uninstall()`` restores both."""
    from uccl_ep_megatron.token_dispatcher import get_options, reset_options

    from uccl_ep_megatron import megatron_plugin
    from uccl_ep_megatron.megatron_plugin import arguments as plugin_arguments

    pkg = tmp_path / "fake_mlm" / "training"
    pkg.mkdir(parents=True)
    (tmp_path / "fake_mlm" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "arguments.py").write_text(_FAKE_ARGUMENTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugin_arguments, "MEGATRON_LM_ARGUMENTS", "fake_mlm.training.arguments")
    add_argument = argparse._ActionsContainer.add_argument
    megatron_plugin.install()
    try:
        assert argparse._ActionsContainer.add_argument is add_argument  # argparse untouched
        from fake_mlm.training.arguments import parse_args  # imported after install

        def own_provider(parser):
            parser.add_argument("--my-flag", type=int, default=0)
            return parser

        argv = ["--moe-token-dispatcher-type", "uccl_ep", "--moe-uccl-ep-num-sms", "16"]
        args = parse_args(own_provider, argv=[*argv, "--my-flag", "3"])
        assert (args.moe_token_dispatcher_type, args.moe_uccl_ep_num_sms, args.my_flag) == (
            "uccl_ep",
            16,
            3,
        )
        assert get_options().num_sms == 16
        assert parse_args(argv=["--moe-uccl-ep-grouped-experts"]).moe_uccl_ep_grouped_experts
    finally:
        megatron_plugin.uninstall()
        reset_options()
    import fake_mlm.training.arguments as module

    assert not any(isinstance(f, plugin_arguments._ParseArgsHook) for f in sys.meta_path)
    with pytest.raises(SystemExit):  # uninstalled: uccl_ep is no choice any more
        module.parse_args(argv=["--moe-token-dispatcher-type", "uccl_ep"])
    sys.modules.pop("fake_mlm.training.arguments", None)


def test_add_arguments_is_an_extra_args_provider():
    from uccl_ep_megatron import megatron_plugin

    parser = _megatron_lm_014_parser()
    assert megatron_plugin.add_arguments(parser) is parser
    args = parser.parse_args(["--moe-token-dispatcher-type", "uccl_ep", "--moe-uccl-ep-metrics"])
    assert args.moe_token_dispatcher_type == "uccl_ep" and args.moe_uccl_ep_metrics is True
    from uccl_ep_megatron.token_dispatcher import reset_options

    reset_options()


VIRTUAL = {"LOCAL_WORLD_SIZE": "4", "UCCL_EP_RANKS_PER_NODE": "2"}
COPY = {"UCCL_EP_IPC_DELIVERY": "copy"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({**VIRTUAL, **COPY}, "EAGER"),  # virtual nodes, the ipc model copying through CUDA
        (VIRTUAL, None),  # store delivery (the default) makes no CUDA call
        ({"LOCAL_WORLD_SIZE": "4", **COPY}, None),  # one node: no ipc transport
        (
            {**VIRTUAL, **COPY, "CUDA_MODULE_LOADING": "LAZY"},
            "LAZY",  # the caller's choice is kept (the transport then refuses it)
        ),
    ],
)
def test_run_asks_for_eager_loading_where_the_ipc_copy_delivery_may_run(env, expected, monkeypatch):
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "show_env.py")
        with open(script, "w") as f:
            f.write("import json, os\nprint(json.dumps(os.environ.get('CUDA_MODULE_LOADING')))\n")
        keys = ("UCCL_EP_RANKS_PER_NODE", "UCCL_EP_TRANSPORT", "UCCL_EP_IPC_DELIVERY")
        base = {k: "" for k in keys}
        proc = _run([sys.executable, "-m", "uccl_ep_megatron.run", script], **{**base, **env})
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == expected
