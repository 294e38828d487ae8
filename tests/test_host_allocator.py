"""The CPU allocator setting (``hybridflow.device.configure_host_allocator``): freed memory is reused, not faulted in."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting applies to glibc only")

SCRIPT = """
import resource, torch
from hybridflow.device import configure_host_allocator
mode = configure_host_allocator()
def faults_of_a_fresh_256_mib_buffer():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = torch.empty(64 * 2**20, dtype=torch.float32)  # 256 MiB: glibc would mmap it
    buffer.fill_(1.0)
    del buffer
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
for _ in range(12):  # the heap grows until freed neighbours coalesce into a block the padded request fits
    faults_of_a_fresh_256_mib_buffer()
warm = resident_mib()
faults = sorted(faults_of_a_fresh_256_mib_buffer() for _ in range(10))
print(mode, faults[len(faults) // 2], resident_mib() - warm)
"""


def faults_in_a_fresh_process(setting: str | None) -> tuple[str, int, int]:
    """The allocator's mode, the median page faults of ten fresh 256 MiB buffers after warming up, and the growth
    of the resident size over those ten (MiB). The median, not the worst: on a shared CI host one buffer in ten
    was once faulted in afresh (65536 faults, never seen in ten runs on a quiet host); the property is the steady
    state, and the growth bound still catches a heap that keeps mapping new memory (ten buffers: 2560 MiB).
    CI hosts have since grown the heap by one buffer (256 MiB) within the ten, in both settings of one run."""
    env = {key: value for key, value in os.environ.items() if key != "HYBRIDFLOW_HOST_ALLOCATOR"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    if setting is not None:
        env["HYBRIDFLOW_HOST_ALLOCATOR"] = setting
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    mode, faults, growth_mib = out.stdout.split()
    return mode, int(faults), int(growth_mib)


@pytest.mark.parametrize("setting", [None, "keep"])
def test_by_default_a_freed_buffer_is_reused_without_faulting_its_pages_in_again_and_memory_stops_growing(setting):
    mode, faults, growth_mib = faults_in_a_fresh_process(setting)
    assert mode == "keep"
    assert faults < 2000  # 65536 pages of 4 KiB if it were mapped afresh
    assert growth_mib < 512  # at most one fresh buffer in ten; a heap that never reuses grows by 2560 MiB


def test_with_system_glibc_keeps_mapping_and_returning_large_buffers():
    mode, faults, _ = faults_in_a_fresh_process("system")
    assert mode == "system"
    assert faults > 30000


def test_an_unknown_setting_is_refused_with_the_variable_named():
    env = dict(os.environ, HYBRIDFLOW_HOST_ALLOCATOR="jemalloc")
    out = subprocess.run([sys.executable, "-c", "from hybridflow.device import configure_host_allocator as c; c()"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "HYBRIDFLOW_HOST_ALLOCATOR must be 'keep' or 'system', got 'jemalloc'" in out.stderr
