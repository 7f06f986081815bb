"""``uccl-ep-megatron doctor``: what this machine offers the EP communication path.

Reports GPUs and their peer (NVLink/xGMI) reachability, RDMA devices (port state, link layer,
MTU, GIDs, EFA or not) from sysfs and, when it loads, libibverbs; GPUDirect RDMA support
(nvidia-peermem / DMA-BUF registration); the transport ``UCCL_EP_TRANSPORT=auto`` would pick;
and the effective value of every registered environment variable. Never raises on a missing
capability: each section says what is absent and why.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from uccl_ep_megatron.core import _c
from uccl_ep_megatron.core.config import env_markdown
from uccl_ep_megatron.core.errors import InvalidInputError
from uccl_ep_megatron.proxy.loading import copies_over_ipc

SYSFS = "/sys"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def rdma_from_sysfs(sysfs_root: str = SYSFS) -> list[dict[str, Any]]:
    """RDMA devices as sysfs lists them (works without libibverbs)."""
    base = os.path.join(sysfs_root, "class", "infiniband")
    out = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        dev = os.path.join(base, name)
        driver = os.path.basename(os.path.realpath(os.path.join(dev, "device", "driver")))
        ports = []
        pdir = os.path.join(dev, "ports")
        for p in sorted(os.listdir(pdir), key=int) if os.path.isdir(pdir) else []:
            pbase = os.path.join(pdir, p)
            gids = []
            gdir = os.path.join(pbase, "gids")
            for i in sorted(os.listdir(gdir), key=int) if os.path.isdir(gdir) else []:
                gid = _read(os.path.join(gdir, i))
                if gid and gid.replace("0", "").replace(":", ""):
                    gtype = _read(os.path.join(pbase, "gid_attrs", "types", i))
                    gids.append((int(i), gid, gtype))
            ports.append(
                {
                    "port": int(p),
                    "state": _read(os.path.join(pbase, "state")).split(":")[-1].strip(),
                    "link_layer": _read(os.path.join(pbase, "link_layer")),
                    "rate": _read(os.path.join(pbase, "rate")),
                    "gids": gids,
                }
            )
        out.append(
            {
                "name": name,
                "driver": driver,
                "efa": driver == "efa" or name.startswith("efa"),
                "ports": ports,
            }
        )
    return out


def gpudirect(proc_root: str = "/proc", sysfs_root: str = SYSFS) -> dict[str, Any]:
    """Peer-memory modules loaded, and whether DMA-BUF registration is available."""
    modules = _read(os.path.join(proc_root, "modules"))
    loaded = {line.split()[0] for line in modules.splitlines() if line}
    peermem = sorted(m for m in ("nvidia_peermem", "nv_peer_mem", "amdgpu") if m in loaded)
    info: dict[str, Any] = {"peer_memory_modules": peermem}
    try:
        info["dmabuf_reg_mr"] = bool(_c.load().verbs_status()["dmabuf_reg"])
    except ImportError:
        info["dmabuf_reg_mr"] = False
    return info


def gpus() -> dict[str, Any]:
    """Visible GPUs, their PCI ids and NUMA CPUs, and which pairs can access each other."""
    out: dict[str, Any] = {"count": 0, "devices": [], "peer_access": [], "note": ""}
    try:
        import torch
    except ImportError:
        out["note"] = "torch is not importable"
        return out
    if not torch.cuda.is_available():
        out["note"] = "no CUDA/ROCm GPU visible to torch"
        return out
    n = torch.cuda.device_count()
    out["count"] = n
    try:
        _C = _c.load()
        bus = getattr(_C, "gpu_pci_bus_id", None)
    except ImportError:
        bus = None
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        d = {"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1)}
        if bus is not None:
            d["pci_bus_id"] = bus(i)
            d["numa_cpus"] = len(_C.numa_cpus_of_pci(d["pci_bus_id"]))
        out["devices"].append(d)
    out["peer_access"] = [
        [i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)] for i in range(n)
    ]
    return out


def collect(sysfs_root: str = SYSFS, proc_root: str = "/proc") -> dict[str, Any]:
    """Everything doctor reports, as a dict (the --json output)."""
    report: dict[str, Any] = {}
    try:
        _C = _c.load()
    except ImportError as e:
        report["build"] = {"error": f"uccl_ep_megatron._C does not import: {e} (pip install .)"}
        _C = None
    if _C is not None:
        report["build"] = dict(_C.build_info)
        report["verbs"] = dict(_C.verbs_status())
    report["gpus"] = gpus()
    report["rdma_sysfs"] = rdma_from_sysfs(sysfs_root)
    report["rdma_verbs"] = []
    if _C is not None and report["verbs"]["loaded"]:
        try:
            report["rdma_verbs"] = [dict(d) for d in _C.list_rdma_devices()]
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            report["verbs"]["list_error"] = str(e)
    report["efa"] = {
        "installed": os.path.isdir("/opt/amazon/efa"),
        "devices": [d["name"] for d in report["rdma_sysfs"] if d["efa"]],
    }
    report["gpudirect"] = gpudirect(proc_root, sysfs_root)
    if _C is not None:
        from uccl_ep_megatron.proxy.endpoint import choose_transport

        # A value that does not parse is diagnosed here; the library would raise on it.
        problems = dict(_C.env_problems())
        env = dict(_C.env_effective(lenient=True))
        report["env"] = {
            p["name"]: {
                "value": env[p["name"]],
                "default": p["default"],
                "set": p["name"] in os.environ,
                **(
                    {"raw": os.environ.get(p["name"]), "error": problems[p["name"]]}
                    if p["name"] in problems
                    else {}
                ),
            }
            for p in _C.env_registry()
        }
        try:
            report["transport"] = choose_transport(str(env["UCCL_EP_TRANSPORT"]))
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            report["transport"] = f"unusable: {e}"
    return report


def render(r: dict[str, Any]) -> str:
    """Human-readable report."""
    lines = []
    b = r.get("build", {})
    lines.append("== build")
    lines.append(
        f"  {b['error']}"
        if "error" in b
        else f"  gpu toolchain: {b.get('gpu')}  verbs: {b.get('verbs')}"
    )
    v = r.get("verbs")
    if v:
        state = "loads" if v["loaded"] else f"unavailable ({v['error']})"
        lines.append(f"  libibverbs: {state}; libefa: {'loads' if v['efa_loaded'] else 'absent'}")
    g = r["gpus"]
    lines.append(f"== GPUs: {g['count']}" + (f" ({g['note']})" if g["note"] else ""))
    for d in g["devices"]:
        extra = f" pci {d['pci_bus_id']} numa-cpus {d['numa_cpus']}" if "pci_bus_id" in d else ""
        lines.append(f"  [{d['index']}] {d['name']} {d['memory_gib']} GiB{extra}")
    if g["peer_access"]:
        lines.append("  peer access (NVLink/xGMI/PCIe P2P):")
        for i, row in enumerate(g["peer_access"]):
            lines.append(f"    {i}: " + " ".join("Y" if x else "." for x in row))
    devs = r["rdma_sysfs"]
    lines.append(
        f"== RDMA devices: {len(devs)}" + ("" if devs else " (no NIC: use the ipc transport)")
    )
    for d in devs:
        lines.append(f"  {d['name']} driver={d['driver']}{' EFA' if d['efa'] else ''}")
        for p in d["ports"]:
            lines.append(f"    port {p['port']}: {p['state']} {p['link_layer']} {p['rate']}")
            for idx, gid, gtype in p["gids"]:
                lines.append(f"      GID[{idx}] {gid} {gtype}")
    e = r["efa"]
    lines.append(f"== EFA: installed={e['installed']} devices={e['devices'] or 'none'}")
    gd = r["gpudirect"]
    lines.append(
        f"== GPUDirect RDMA: peer-memory modules={gd['peer_memory_modules'] or 'none'} "
        f"dmabuf registration={'yes' if gd['dmabuf_reg_mr'] else 'no'}"
    )
    if "transport" in r:
        lines.append(f"== transport (UCCL_EP_TRANSPORT resolved): {r['transport']}")
        if r["transport"] == "ipc" and g["count"] and copies_over_ipc(os.environ):
            # proxy/loading.py: the ipc copy delivery refuses lazy module loading on a GPU.
            mode = os.environ.get("CUDA_MODULE_LOADING", "unset: the driver loads lazily")
            lines.append(
                "  ipc with UCCL_EP_IPC_DELIVERY=copy on a GPU needs CUDA_MODULE_LOADING=EAGER "
                f"in every rank (now: {mode}); uccl-ep-megatron train and python -m "
                "uccl_ep_megatron.run set it for virtual nodes"
            )
    if "env" in r:
        lines.append("== environment (effective)")
        for name, x in r["env"].items():
            if "error" in x:
                lines.append(
                    f"  {name}={x['raw']!r}  INVALID: every use of the library raises: {x['error']}"
                )
                continue
            lines.append(f"  {name}={x['value']}" + ("" if x["set"] else "  (default)"))
    return "\n".join(lines)


def register(subparsers: Any) -> None:
    """Adds ``doctor``."""
    p = subparsers.add_parser(
        "doctor", help="GPUs, NVLink, RDMA devices, EFA, GPUDirect and effective env values"
    )
    p.add_argument("--json", default="", help="also write the report to this JSON file")
    p.add_argument(
        "--markdown",
        action="store_true",
        help="print only the environment registry as the Markdown table of docs/configuration.md",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the report (and write JSON). Exit 0 whatever the machine lacks (absence is
    information); 1 when an environment variable holds a value every use of the library
    rejects, with one line on stderr naming them. ``--markdown``: the env table only."""
    if args.markdown:
        print(env_markdown())
        return 0
    if args.json:
        parent = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(parent):
            raise InvalidInputError(
                f"--json {args.json}: directory {parent} does not exist; create it or write "
                "the report elsewhere"
            )
    r = collect()
    print(render(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2, default=str)
    invalid = [f"{name}={x['raw']!r}" for name, x in r.get("env", {}).items() if "error" in x]
    if invalid:
        print(
            f"uccl-ep-megatron doctor: error: invalid environment: {', '.join(invalid)}; every "
            "use of the library raises on these (see INVALID above): fix or unset them",
            file=sys.stderr,
        )
        return 1
    return 0
