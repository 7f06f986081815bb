"""``uccl-ep-megatron doctor`` (CPU): report structure, sysfs parsing, CLI output."""

from __future__ import annotations

import json
import os

from uccl_ep_megatron import _C, cli
from uccl_ep_megatron.cli import doctor


def _fake_sysfs(root):
    port = os.path.join(root, "class", "infiniband", "mlx5_0", "ports", "1")
    os.makedirs(os.path.join(port, "gids"))
    os.makedirs(os.path.join(port, "gid_attrs", "types"))
    with open(os.path.join(port, "state"), "w") as f:
        f.write("4: ACTIVE\n")
    with open(os.path.join(port, "link_layer"), "w") as f:
        f.write("Ethernet\n")
    with open(os.path.join(port, "rate"), "w") as f:
        f.write("400 Gb/sec (4X NDR)\n")
    gids = [
        "fe80:0000:0000:0000:0a00:27ff:fe00:0001",
        "0000:0000:0000:0000:0000:ffff:0a00:0001",
        "0000:0000:0000:0000:0000:0000:0000:0000",
    ]
    for i, g in enumerate(gids):
        with open(os.path.join(port, "gids", str(i)), "w") as f:
            f.write(g + "\n")
        with open(os.path.join(port, "gid_attrs", "types", str(i)), "w") as f:
            f.write("RoCE v2\n")
    efa = os.path.join(root, "class", "infiniband", "rdmap0", "device")
    os.makedirs(efa)
    os.makedirs(os.path.join(root, "drivers", "efa"))
    os.symlink(os.path.join(root, "drivers", "efa"), os.path.join(efa, "driver"))


def test_sysfs_parsing(tmp_path):
    _fake_sysfs(str(tmp_path))
    devs = {d["name"]: d for d in doctor.rdma_from_sysfs(str(tmp_path))}
    assert set(devs) == {"mlx5_0", "rdmap0"}
    p = devs["mlx5_0"]["ports"][0]
    assert p["state"] == "ACTIVE" and p["link_layer"] == "Ethernet"
    assert [g[0] for g in p["gids"]] == [0, 1]  # the zero GID is not listed
    assert devs["rdmap0"]["efa"] and not devs["mlx5_0"]["efa"]


def test_collect_covers_every_env_variable():
    r = doctor.collect()
    assert set(r["env"]) == {p["name"] for p in _C.env_registry()}
    assert r["transport"] in ("ipc", "verbs")
    assert r["build"]["gpu"] in ("cuda", "hip", "none")
    assert isinstance(r["gpus"]["count"], int)


def test_cli_prints_sections_and_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("UCCL_EP_NUM_PROXY_THREADS", "6")
    out_json = tmp_path / "doctor.json"
    assert cli.main(["doctor", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    for section in (
        "== build",
        "== GPUs",
        "== RDMA devices",
        "== EFA",
        "== GPUDirect",
        "== environment",
    ):
        assert section in text
    assert "UCCL_EP_NUM_PROXY_THREADS=6" in text
    data = json.loads(out_json.read_text())
    assert data["env"]["UCCL_EP_NUM_PROXY_THREADS"]["value"] == 6
    assert data["env"]["UCCL_EP_NUM_PROXY_THREADS"]["set"] is True


def test_doctor_diagnoses_a_value_that_does_not_parse(capsys, monkeypatch):
    monkeypatch.setenv("UCCL_EP_TIMEOUT_MS", "ten seconds")
    monkeypatch.setenv("UCCL_EP_IPC_REORDER", "maybe")
    assert cli.main(["doctor"]) == 1  # the report, and exit 1: the library would raise
    captured = capsys.readouterr()
    text = captured.out
    assert "invalid environment: UCCL_EP_TIMEOUT_MS='ten seconds'" in captured.err
    assert "UCCL_EP_TIMEOUT_MS='ten seconds'  INVALID" in text
    assert "is not an integer" in text
    assert "UCCL_EP_IPC_REORDER='maybe'  INVALID" in text and "is not a boolean" in text
    assert "UCCL_EP_NUM_PROXY_THREADS=4" in text  # the others are still reported


def test_render_says_the_ipc_copy_delivery_needs_eager_loading_on_a_gpu(monkeypatch):
    r = doctor.collect()
    r["transport"] = "ipc"
    r["gpus"] = {"count": 1, "note": "", "devices": [], "peer_access": []}
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    monkeypatch.delenv("UCCL_EP_IPC_DELIVERY", raising=False)
    assert "CUDA_MODULE_LOADING" not in doctor.render(r)  # store delivery: no CUDA call
    monkeypatch.setenv("UCCL_EP_IPC_DELIVERY", "copy")
    text = doctor.render(r)
    assert "ipc with UCCL_EP_IPC_DELIVERY=copy on a GPU needs CUDA_MODULE_LOADING=EAGER" in text
    assert "now: unset: the driver loads lazily" in text
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    assert "(now: EAGER)" in doctor.render(r)
    r["gpus"]["count"] = 0  # host regions only: nothing to load
    assert "CUDA_MODULE_LOADING" not in doctor.render(r)
