"""Render (and optionally submit) multi-node jobs for a recipe: slurm sbatch or plain torchrun.

A :class:`LaunchPlan` holds everything a job needs, as data: node and GPU counts, the NIC
environment (preset + recipe ``dispatcher`` knobs + user ``--env``), the container, and the
program torchrun starts on every node. :func:`render` turns it into a bash script from the
templates in ``launch/`` (``sbatch.sh.in`` for slurm, ``node.sh.in`` for hosts without a
scheduler). Three targets:

- ``train``: this package's built-in pretraining job (``python -m uccl_ep_megatron.cli train``).
- ``megatron``: an unmodified Megatron-LM ``pretrain_gpt.py`` through
  ``python -m uccl_ep_megatron.run`` (installs the ``uccl_ep`` dispatcher plugin first).
- ``primus``: AMD Primus' ``primus/cli/main.py train pretrain --config EXP`` with the recipe
  as ``--key value`` overrides, through the same plugin runner.
"""

from __future__ import annotations

import functools
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from uccl_ep_megatron.core.errors import InvalidInputError, UnsupportedError
from uccl_ep_megatron.core.paths import data_dirs

TARGETS = ("train", "megatron", "primus")
SCHEDULERS = ("slurm", "none")
CONTAINER_RUNTIMES = ("pyxis", "docker")
DEFAULT_MASTER_PORT = 29500

# What each `#SBATCH` option of plan_launch may hold. The value lands in a shell script
# verbatim: anything else (a newline, a quote, `$(...)`) would change the script.
_SLURM_NAMES = r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*"
_SLURM_TIME = (
    r"(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}|\d+-\d{1,2}:\d{1,2}"
    r"|\d+-\d{1,2}:\d{1,2}:\d{1,2}|UNLIMITED|INFINITE)"
)
_SBATCH_OPTIONS = {
    "partition": (_SLURM_NAMES, "partition names (letters, digits, _ . -), comma-separated"),
    "account": (_SLURM_NAMES, "an account name (letters, digits, _ . -)"),
    "time": (
        _SLURM_TIME,
        "a slurm time limit: MINUTES, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED",
    ),
}


def launch_dir() -> Path:
    """Folder of the launch templates and ``nic_presets.yaml`` (installed or source tree)."""
    candidates = data_dirs("launch")
    for d in candidates:
        if (d / "nic_presets.yaml").is_file():
            return d
    raise UnsupportedError(
        f"launch templates not found under {' or '.join(map(str, candidates))}; "
        "reinstall the package (pip install .)"
    )


@functools.cache
def nic_presets() -> dict[str, dict[str, Any]]:
    """NIC environment presets by name (``launch/nic_presets.yaml``)."""
    data = yaml.safe_load((launch_dir() / "nic_presets.yaml").read_text())
    for name, preset in data.items():
        env = preset.get("env") or {}
        if not all(isinstance(v, str) for v in env.values()):
            raise UnsupportedError(f"nic preset {name!r}: every env value must be a quoted string")
    return data


@dataclass
class LaunchPlan:
    """Everything a rendered job runs, as data (tests and ``--dry-run`` read it)."""

    recipe: str
    description: str
    target: str
    scheduler: str
    nodes: int
    gpus_per_node: int
    nic_preset: str
    env: dict[str, str]
    program: list[str]
    program_array: tuple[str, list[str]] | None = None
    container_runtime: str | None = None
    container_image: str | None = None
    container_mounts: list[str] = field(default_factory=list)
    gpu_vendor: str = "nvidia"
    sbatch_options: dict[str, str] = field(default_factory=dict)
    log_dir: str = "logs"
    master_port: int = DEFAULT_MASTER_PORT

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def job_name(self) -> str:
        return "uccl-ep-" + self.recipe.replace("/", "-")

    def torchrun_args(self) -> list[str]:
        """torchrun's own arguments (rendezvous values as the script's shell variables)."""
        common = [f"--nnodes={self.nodes}", f"--nproc-per-node={self.gpus_per_node}"]
        if self.scheduler == "slurm":
            return common + [
                "--rdzv-backend=c10d",
                "--rdzv-endpoint=${MASTER_ADDR}:${MASTER_PORT}",
                "--rdzv-id=${SLURM_JOB_ID}",
            ]
        return common + [
            "--node-rank=${NODE_RANK}",
            "--master-addr=${MASTER_ADDR}",
            "--master-port=${MASTER_PORT}",
        ]


def _program(recipe, target: str, world_size: int, opts: dict[str, Any]):
    """(program words, optional (array name, array items)) torchrun runs on every node."""
    dispatcher = opts.get("dispatcher") or recipe.dispatcher["type"]
    data_path = opts.get("data_path")
    if target == "train":
        words = ["-m", "uccl_ep_megatron.cli", "train", "--recipe", recipe.name]
        words += ["--dispatcher", dispatcher]
        for override in opts.get("overrides_text") or []:
            words += ["--set", override]
        if data_path:
            words += ["--data-path", data_path]
        if opts.get("run_dir"):
            words += ["--run-dir", opts["run_dir"]]
        if opts.get("wandb_project"):
            words += ["--wandb-project", opts["wandb_project"]]
        return [shlex.quote(w) for w in words], None
    margs = recipe.megatron_args(world_size, dispatcher=dispatcher)
    margs += ["--data-path", data_path] if data_path else ["--mock-data"]
    margs += ["--split", "99,1,0"] if data_path else []
    if opts.get("checkpoint_dir"):
        margs += ["--save", opts["checkpoint_dir"], "--load", opts["checkpoint_dir"]]
    if opts.get("wandb_project"):
        margs += ["--wandb-project", opts["wandb_project"], "--wandb-exp-name", recipe.name]
    if target == "megatron":
        if not opts.get("megatron_path"):
            raise InvalidInputError(
                "--target megatron needs --megatron-path DIR (a Megatron-LM checkout with "
                "pretrain_gpt.py)"
            )
        script = f"{opts['megatron_path'].rstrip('/')}/pretrain_gpt.py"
        words = ["-m", "uccl_ep_megatron.run", shlex.quote(script), '"${MEGATRON_ARGS[@]}"']
        return words, ("MEGATRON_ARGS", margs)
    # Primus takes its experiment YAML plus `--key value` overrides in config (underscore) names.
    if not opts.get("primus_path") or not opts.get("primus_config"):
        raise InvalidInputError(
            "--target primus needs --primus-path DIR (a Primus checkout) and --primus-config "
            "EXP.yaml (its experiment file, e.g. examples/megatron/configs/MI300X/"
            "deepseek_v3-BF16-pretrain.yaml)"
        )
    overrides: list[str] = []
    i = 0
    while i < len(margs):
        key = margs[i][2:].replace("-", "_")
        if i + 1 < len(margs) and not margs[i + 1].startswith("--"):
            overrides += [f"--{key}", margs[i + 1]]
            i += 2
        else:
            overrides += [f"--{key}", "true"]
            i += 1
    script = f"{opts['primus_path'].rstrip('/')}/primus/cli/main.py"
    words = ["-m", "uccl_ep_megatron.run", shlex.quote(script), "train", "pretrain"]
    words += ["--config", shlex.quote(opts["primus_config"])]
    if opts.get("megatron_path"):
        words += ["--backend_path", shlex.quote(opts["megatron_path"])]
    words.append('"${PRIMUS_OVERRIDES[@]}"')
    return words, ("PRIMUS_OVERRIDES", overrides)


def plan_launch(
    recipe,
    *,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    target: str = "train",
    scheduler: str = "slurm",
    nic_preset: str | None = None,
    extra_env: dict[str, str] | None = None,
    container_runtime: str | None = None,
    container_image: str | None = None,
    container_mounts: list[str] | None = None,
    sbatch_options: dict[str, str] | None = None,
    log_dir: str = "logs",
    master_port: int = DEFAULT_MASTER_PORT,
    **program_opts: Any,
) -> LaunchPlan:
    """Build the :class:`LaunchPlan` of ``recipe`` on ``nodes`` x ``gpus_per_node`` GPUs.

    Args:
        recipe: a :class:`uccl_ep_megatron.training.recipes.Recipe`.
        nodes, gpus_per_node: job size (default: the recipe's ``cluster`` section).
        target: ``train``, ``megatron`` or ``primus``.
        scheduler: ``slurm`` (sbatch script) or ``none`` (a script run on every node).
        nic_preset: overrides ``cluster.nic_preset``.
        extra_env: more variables, exported after the preset's (they win).
        container_runtime, container_image, container_mounts: ``pyxis`` (enroot through
            ``srun --container-image``) or ``docker``; image default ``cluster.container_image``.
        sbatch_options: extra ``#SBATCH --key=value`` lines (partition, account, time).
        program_opts: ``dispatcher``, ``data_path``, ``checkpoint_dir``, ``megatron_path``,
            ``primus_path``, ``primus_config``, ``run_dir``, ``wandb_project``,
            ``overrides_text`` (the ``--set`` strings, forwarded to ``train``).

    Raises:
        InvalidInputError: unknown target/scheduler/preset/runtime, bad sizes, or a world size
            the recipe's parallelism cannot use.
    """
    if target not in TARGETS:
        raise InvalidInputError(f"unknown launch target {target!r}; use one of {list(TARGETS)}")
    for key, value in (sbatch_options or {}).items():
        if key not in _SBATCH_OPTIONS:
            raise InvalidInputError(
                f"sbatch option {key!r} is not supported; use {', '.join(_SBATCH_OPTIONS)}"
            )
        pattern, what = _SBATCH_OPTIONS[key]
        if not isinstance(value, str) or not re.fullmatch(pattern, value, re.IGNORECASE):
            raise InvalidInputError(f"--{key}={value!r} must be {what}")
    if scheduler not in SCHEDULERS:
        raise InvalidInputError(f"unknown scheduler {scheduler!r}; use one of {list(SCHEDULERS)}")
    nodes = int(nodes if nodes is not None else recipe.cluster["nodes"])
    gpus = int(gpus_per_node if gpus_per_node is not None else recipe.cluster["gpus_per_node"])
    if nodes < 1 or gpus < 1:
        raise InvalidInputError(f"--nodes ({nodes}) and --gpus-per-node ({gpus}) must be >= 1")
    presets = nic_presets()
    preset_name = nic_preset or recipe.cluster["nic_preset"]
    if preset_name not in presets:
        raise InvalidInputError(
            f"unknown NIC preset {preset_name!r}; presets: {', '.join(sorted(presets))}"
        )
    if container_runtime is not None and container_runtime not in CONTAINER_RUNTIMES:
        raise InvalidInputError(
            f"unknown container runtime {container_runtime!r}; "
            f"use one of {list(CONTAINER_RUNTIMES)}"
        )
    image = container_image or recipe.cluster.get("container_image")
    if container_runtime and not image:
        raise InvalidInputError(
            f"--container {container_runtime} needs an image: pass --container-image IMAGE "
            "or set cluster.container_image in the recipe"
        )
    world = nodes * gpus
    recipe.resolved_parallelism(world)  # fail before rendering if the job cannot run
    preset = presets[preset_name]
    env = dict(preset.get("env") or {})
    env.update(recipe.dispatcher_env())
    env.update(extra_env or {})
    for key in env:
        if not key.replace("_", "").isalnum() or key[0].isdigit():
            raise InvalidInputError(f"environment variable name {key!r} is not a valid name")
    program, array = _program(recipe, target, world, program_opts)
    vendor = preset.get("vendor", "any")
    if vendor == "any":
        vendor = "amd" if recipe.cluster["gpu"].upper().startswith("MI") else "nvidia"
    return LaunchPlan(
        recipe=recipe.name,
        description=recipe.description,
        target=target,
        scheduler=scheduler,
        nodes=nodes,
        gpus_per_node=gpus,
        nic_preset=preset_name,
        env=env,
        program=program,
        program_array=array,
        container_runtime=container_runtime if image else None,
        container_image=image if container_runtime else None,
        container_mounts=list(container_mounts or []),
        gpu_vendor=vendor,
        sbatch_options=dict(sbatch_options or {}),
        log_dir=log_dir,
        master_port=master_port,
    )


def _env_exports(plan: LaunchPlan) -> str:
    lines = [f'export {k}="${{{k}:-{_dq(v)}}}"' for k, v in plan.env.items()]
    # UCCL-EP's own names default to the NCCL values a cluster already has (docs/configuration.md).
    lines += [
        'if [ -n "${NCCL_IB_GID_INDEX:-}" ]; then',
        '  export UCCL_IB_GID_INDEX="${UCCL_IB_GID_INDEX:-${NCCL_IB_GID_INDEX}}"',
        "fi",
    ]
    return "\n".join(lines)


def _quote(word: str) -> str:
    """shlex.quote, plus quotes around commas (shellcheck reads bare ones in arrays as typos)."""
    quoted = shlex.quote(word)
    return f"'{word}'" if quoted == word and "," in word else quoted


def _dq(value: str) -> str:
    """Escape for the inside of a double-quoted shell word."""
    return "".join("\\" + c if c in '"\\$`' else c for c in value)


def _container(plan: LaunchPlan) -> str:
    if not plan.container_runtime:
        return ""
    mounts = plan.container_mounts
    if plan.container_runtime == "pyxis":
        if plan.scheduler != "slurm":
            raise InvalidInputError(
                "--container pyxis needs --scheduler slurm (it is an srun plugin)"
            )
        words = [f"--container-image={shlex.quote(plan.container_image)}"]
        if mounts:
            words.append("--container-mounts=" + shlex.quote(",".join(mounts)))
        return " ".join(words) + " "
    words = ["docker", "run", "--rm", "--network=host", "--ipc=host", "--ulimit", "memlock=-1"]
    words += ["--device=/dev/infiniband", "--cap-add=IPC_LOCK"]
    if plan.gpu_vendor == "amd":
        words += ["--device=/dev/kfd", "--device=/dev/dri", "--group-add=video"]
    else:
        words += ["--gpus=all"]
    names = [*plan.env, "UCCL_IB_GID_INDEX", "MASTER_ADDR", "MASTER_PORT"]
    words += [f"--env={n}" for n in names]
    words += [f"--volume={shlex.quote(m)}" for m in mounts]
    words.append(shlex.quote(plan.container_image))
    return " ".join(words) + " "


def render(plan: LaunchPlan) -> str:
    """The job script of ``plan`` (bash; passes ``bash -n`` and ``shellcheck``)."""
    template = "sbatch.sh.in" if plan.scheduler == "slurm" else "node.sh.in"
    text = (launch_dir() / template).read_text()
    extra = "\n".join(f"#SBATCH --{k}={v}" for k, v in plan.sbatch_options.items())
    if plan.program_array:
        name, items = plan.program_array
        lines, i = [], 0
        while i < len(items):  # one "--flag value" pair per line, for a reader
            pair = (
                items[i : i + 2]
                if i + 1 < len(items) and not items[i + 1].startswith("--")
                else items[i : i + 1]
            )
            lines.append("  " + " ".join(_quote(a) for a in pair))
            i += len(pair)
        body = "\n".join(lines)
        array = f"{name}=(\n{body}\n)"
    else:
        array = "# (the program takes no argument array)"
    values = {
        "RECIPE": plan.recipe,
        "DESCRIPTION": plan.description.replace("\n", " "),
        "TARGET": plan.target,
        "NODES": str(plan.nodes),
        "GPUS_PER_NODE": str(plan.gpus_per_node),
        "WORLD_SIZE": str(plan.world_size),
        "LAST_NODE_RANK": str(plan.nodes - 1),
        "JOB_NAME": plan.job_name,
        "LOG_DIR": plan.log_dir,
        "SBATCH_EXTRA": extra,
        "NIC_PRESET": plan.nic_preset,
        "ENV_EXPORTS": _env_exports(plan),
        "MASTER_PORT": str(plan.master_port),
        "PROGRAM_ARRAY": array,
        "CONTAINER": _container(plan),
        "PROGRAM": " ".join(plan.program),
    }
    if not extra:
        text = text.replace("@SBATCH_EXTRA@\n", "")
    for key, value in values.items():
        text = text.replace(f"@{key}@", value)
    return text


def write_script(plan: LaunchPlan, out_dir: Path) -> Path:
    """Write the rendered script to ``out_dir`` (``job.sbatch`` or ``node.sh``); return its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("job.sbatch" if plan.scheduler == "slurm" else "node.sh")
    path.write_text(render(plan))
    path.chmod(0o755)
    return path


def submit(path: Path, timeout_s: float = 120.0) -> str:
    """``sbatch path``; returns sbatch's output (the job id line).

    Raises:
        UnsupportedError: ``sbatch`` is not on PATH, or it failed (its stderr is included).
    """
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise UnsupportedError(
            "sbatch is not on PATH: run --submit on a slurm login node, or use --dry-run / the "
            f"written script {path} with your scheduler"
        )
    try:
        proc = subprocess.run(
            [sbatch, str(path)], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise UnsupportedError(f"sbatch {path} did not answer within {timeout_s:.0f} s") from exc
    if proc.returncode != 0:
        raise UnsupportedError(
            f"sbatch {path} failed (exit {proc.returncode}): {proc.stderr.strip()}"
        )
    return proc.stdout.strip()


__all__ = [
    "CONTAINER_RUNTIMES",
    "LaunchPlan",
    "SCHEDULERS",
    "TARGETS",
    "launch_dir",
    "nic_presets",
    "plan_launch",
    "render",
    "submit",
    "write_script",
]
