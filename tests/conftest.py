"""Shared fixtures: one local Ray instance per test session, one torch thread per process."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the equivalence tests compare against fp32 references: `dtype: auto` stays fp32 on CPUs with bf16
# instructions too (tests that exercise bf16 ask for it, or monkeypatch this)
os.environ.setdefault("HYBRIDFLOW_CPU_DTYPE", "float32")


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance shared by every test of the session (started once, shut down at the end).

    It offers 16 logical CPUs on this 2-core machine: workers are tiny and mostly wait on each
    other, so the logical count only bounds how many can be placed, not how fast they run.
    """
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=True,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled",
                                            "HYBRIDFLOW_CPU_DTYPE": os.environ["HYBRIDFLOW_CPU_DTYPE"]}})
    yield ray
    ray.shutdown()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a GPU machine with fewer GPUs than a test's world size, the test (or its fixture) is skipped."""
    from hybridflow.device import NotEnoughDevicesError

    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None and call.excinfo.errisinstance(NotEnoughDevicesError):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {call.excinfo.value}")
