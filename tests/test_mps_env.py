"""The MPS control daemon's environment (``cluster.local.Mps``), against a stand-in control
program that records the environment it was started with (a real subprocess): the daemon, and
so the MPS server it starts, must not inherit the caller's ``CUDA_VISIBLE_DEVICES``. A client's
``CUDA_VISIBLE_DEVICES`` is read against the devices the server sees, so a server started with
``2,3`` would leave clients that ask for ``2,3`` without any GPU ("No CUDA GPUs are
available")."""

from __future__ import annotations

import os
import stat

from uccl_ep_megatron.cluster.local import Mps


def _recording_control(tmp_path) -> tuple[str, str]:
    """A control program that appends its argv and its whole environment (``env -0``) to a
    file, and makes the control pipe as the real daemon does."""
    record = tmp_path / "env.rec"
    script = tmp_path / "fake-mps-control"
    script.write_text(
        "#!/bin/sh\n"
        f'printf "argv=%s\\0" "$*" >> {record}\n'
        f"env -0 >> {record}\n"
        f'printf "\\0--end--\\0" >> {record}\n'
        'if [ "$1" = "-d" ]; then : > "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi\n'
        "cat > /dev/null\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script), str(record)


def _runs(record: str) -> list[tuple[str, dict[str, str]]]:
    """Each run of the control program: (its argv, its environment)."""
    runs = []
    for block in open(record, "rb").read().decode().split("\0--end--\0"):
        items = [i for i in block.split("\0") if i]
        if not items:
            continue
        argv = items[0].removeprefix("argv=")
        runs.append((argv, dict(i.split("=", 1) for i in items[1:])))
    return runs


def test_the_daemon_sees_every_gpu_and_the_callers_list_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setenv("UCCL_EP_MPS_TEST_MARK", "kept")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)
    control, record = _recording_control(tmp_path)
    mps = Mps(control=control, start_timeout_s=5)
    mps.start()
    try:
        pipe = os.path.join(mps.dir, "pipe")
        # The ranks spawned from here still select GPUs 2 and 3 themselves.
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == pipe
    finally:
        mps.stop()
    runs = _runs(record)
    assert [argv for argv, _ in runs] == ["-d", ""], runs
    for argv, env in runs:
        assert "CUDA_VISIBLE_DEVICES" not in env, (argv, env.get("CUDA_VISIBLE_DEVICES"))
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == pipe, argv
        assert env["UCCL_EP_MPS_TEST_MARK"] == "kept", argv  # the rest is inherited
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
