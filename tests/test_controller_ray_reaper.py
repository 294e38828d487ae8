"""The Ray reaper: after the driver dies, exactly the processes of the driver's own Ray node are killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hybridflow.controller.ray_reaper import check_identity, node_processes

NODE_ID = uuid.uuid4().hex + uuid.uuid4().hex[:24]
SESSION = "/tmp/ray/session_2026-01-01_00-00-00_000000_1"
REAPER_FILE = str(Path(__file__).parents[1] / "hybridflow" / "controller" / "ray_reaper.py")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _fake_process(proc: Path, pid: int, *, cmdline: list[str], environ: list[str]) -> None:
    entry = proc / str(pid)
    entry.mkdir()
    (entry / "cmdline").write_bytes("\0".join(cmdline).encode() + b"\0")
    (entry / "environ").write_bytes("\0".join(environ).encode() + b"\0")


def test_only_processes_of_the_node_match_exactly(tmp_path):
    _fake_process(tmp_path, 1, cmdline=["init", f"--session-dir={SESSION}"], environ=[])  # pid 1: never
    _fake_process(tmp_path, 10, cmdline=["raylet", f"--session_dir={SESSION}"], environ=[])
    _fake_process(tmp_path, 11, cmdline=["ray::DashboardAgent"], environ=["A=1", f"RAY_NODE_ID={NODE_ID}"])
    _fake_process(tmp_path, 12, cmdline=["gcs_server", f"--log_dir={SESSION}/logs"], environ=[])
    _fake_process(tmp_path, 20, cmdline=["ray::IDLE"], environ=[f"RAY_NODE_ID={NODE_ID}0"])  # another id
    _fake_process(tmp_path, 21, cmdline=["raylet", f"--session_dir={SESSION}0/logs"], environ=[])  # another session
    _fake_process(tmp_path, 22, cmdline=["bash", "b"], environ=[f"NOTE=RAY_NODE_ID={NODE_ID}"])
    _fake_process(tmp_path, 23, cmdline=["python"], environ=[])
    (tmp_path / "self").mkdir()
    assert sorted(node_processes(NODE_ID, SESSION, exclude={11}, proc=tmp_path)) == [10, 12]
    assert sorted(node_processes(NODE_ID, SESSION, exclude=set(), proc=tmp_path)) == [10, 11, 12]


@pytest.mark.parametrize(("node_id", "session_dir", "field"), [
    ("a", SESSION, "node_id"), ("", SESSION, "node_id"), (NODE_ID.upper(), SESSION, "node_id"),
    (NODE_ID, "b", "session_dir"), (NODE_ID, "/tmp/ray", "session_dir"), (NODE_ID, "session_x", "session_dir"),
])
def test_the_reaper_refuses_anything_but_a_real_node_id_and_session_dir(node_id, session_dir, field):
    with pytest.raises(ValueError, match=field):
        check_identity(node_id, session_dir)


def test_when_the_driver_is_killed_the_reaper_kills_the_nodes_processes_and_nothing_else():
    node_process = subprocess.Popen(["sleep", "300"], env={**os.environ, "RAY_NODE_ID": NODE_ID})
    bystander = subprocess.Popen(["sleep", "300"], env={**os.environ, "RAY_NODE_ID": NODE_ID + "00"})
    driver = subprocess.Popen(
        [sys.executable, "-c", (
            "import importlib.util, time\n"  # the module alone: no torch, no Ray
            f"spec = importlib.util.spec_from_file_location('reaper', {REAPER_FILE!r})\n"
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
            f"print(module.start_reaper(node_id={NODE_ID!r}, session_dir={SESSION!r}).pid, flush=True)\n"
            "time.sleep(300)\n")],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        reaper_pid = int(driver.stdout.readline())
        assert node_process.poll() is None
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        assert node_process.wait(timeout=60) == -signal.SIGTERM
        deadline = time.monotonic() + 60
        while _alive(reaper_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(reaper_pid)  # the reaper has finished: whatever it would kill is killed
        assert bystander.poll() is None
    finally:
        for process in (node_process, bystander, driver):
            if process.poll() is None:
                process.kill()
                process.wait()


DRIVER = """
import os, time
import ray
from hybridflow.controller import ResourcePool, Worker, WorkerGroup, register

class Probe(Worker):
    @register("ONE_TO_ALL")
    def pid(self):
        return os.getpid()

group = WorkerGroup(ResourcePool([1], name="reaped"), Probe)
print(ray.get_runtime_context().get_node_id(), group.pid()[0], flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_killing_a_driver_that_started_ray_leaves_no_ray_process_behind(tmp_path):
    from hybridflow.controller.resource_pool import running_cluster_address

    if running_cluster_address() is not None:
        pytest.skip("a Ray cluster is running here: the driver would join it instead of starting its own")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "RAY_ADDRESS": ""}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, env=env,
                              cwd=tmp_path)
    try:
        node_id, worker_pid = driver.stdout.readline().split()
        assert _alive(int(worker_pid))
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            left = [pid for pid in node_processes(node_id, "/tmp/ray/session_none", exclude=set()) if _alive(pid)]
            if not left:
                break
            time.sleep(0.5)
        assert left == []
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
