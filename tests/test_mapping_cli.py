"""`hybridflow plan` and `hybridflow calibrate`: output, written config, errors, measured profile."""

from __future__ import annotations

import pytest
import yaml

from hybridflow.mapping import Cluster, Plan, Workload, load_hardware, plan
from hybridflow.mapping.cli import plan_main
from hybridflow.calibrate import calibrate_main

TINY_PPO = ["--actor", "tiny", "--critic", "tiny", "--prompt-len", "32", "--response-len", "32", "--batch", "16"]


def test_plan_prints_the_plan_and_writes_the_config_fragment_the_api_returns(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    argv = ["--actor", "llama-7b", "--critic", "llama-7b", "--devices", "16", "--per-node", "8",
            "--prompt-len", "1024", "--response-len", "1024", "--batch", "1024", "--top", "4", "--write", str(out)]
    assert plan_main(argv) == 0
    printed = capsys.readouterr().out
    expected = plan("ppo", {role: "llama-7b" for role in ("actor", "critic", "reference", "reward")},
                    Workload(prompts_per_step=1024, prompt_length=1024, response_length=1024),
                    Cluster(num_devices=16, devices_per_node=8, hardware=load_hardware("a100-80g")), top=4)
    assert expected.describe() in printed
    assert f"{expected.total_seconds:>9.1f}s" in printed
    assert len([line for line in printed.splitlines() if line.lstrip()[:2] in ("1 ", "2 ", "3 ", "4 ")]) == 4
    written = yaml.safe_load(out.read_text())
    assert written == expected.to_config_fragment()
    assert Plan.from_config_fragment(written) == expected.without_prediction()
    # the header says which batch the plan was searched for (its layouts split exactly that evenly)
    assert ("# planned for: 1024 prompts per step x 1 samples, prompt 1024 + response 1024 tokens, mini-batch "
            "1024 samples, 1 epoch(s), micro-batch tokens 2048") in out.read_text()


def test_plan_for_an_algorithm_without_critic_defaults_reference_and_reward_to_the_actor(capsys):
    argv = ["--algorithm", "grpo", "--actor", "tiny", "--devices", "2", "--per-node", "2",
            "--prompt-len", "16", "--response-len", "16", "--batch", "8", "--hardware", "h100-80g"]
    assert plan_main(argv) == 0
    printed = capsys.readouterr().out
    assert "grpo on 2 x h100-80g" in printed
    assert "critic" not in printed and "reference" in printed and "reward" in printed


@pytest.mark.parametrize("extra, message", [
    (["--devices", "12"], "--devices got 12; allowed: at most --per-node (8) or a multiple of it (whole nodes)"),
    (["--devices", "8", "--hardware", "tpu"],
     "unknown hardware 'tpu'; known: a100-80g, h100-80g, h200, cpu-local, cuda-local"),
    (["--devices", "8", "--reward", "gpt-9"], "unknown model 'gpt-9'"),
    (["--devices", "8", "--batch", "0"], "--batch got 0; allowed: an integer >= 1"),
])
def test_plan_reports_bad_input_on_stderr_with_exit_code_2(extra, message, capsys):
    assert plan_main(TINY_PPO + extra) == 2
    assert message in capsys.readouterr().err


def test_plan_reports_a_missing_write_folder_and_bad_profile_files_without_a_traceback(tmp_path, capsys):
    missing = tmp_path / "nowhere" / "plan.yaml"
    assert plan_main(TINY_PPO + ["--devices", "8", "--write", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"--write '{missing}': folder '{missing.parent}' does not exist; create it first" in err
    assert "Traceback" not in err and not missing.parent.exists()
    broken = tmp_path / "gpu.json"
    broken.write_text('{"name": "gpu",')
    assert plan_main(TINY_PPO + ["--devices", "8", "--hardware", str(broken)]) == 2
    assert f"hardware profile {broken} is not valid JSON" in capsys.readouterr().err
    broken.write_text('{"name": "gpu"}')
    assert plan_main(TINY_PPO + ["--devices", "8", "--hardware", str(broken)]) == 2
    assert f"{broken}: hardware profile lacks the required fields" in capsys.readouterr().err


def test_plan_with_a_rule_based_reward_places_no_reward_model(tmp_path):
    out = tmp_path / "plan.yaml"
    argv = ["--actor", "tiny", "--critic", "tiny", "--reward", "none", "--devices", "4", "--per-node", "4",
            "--prompt-len", "16", "--response-len", "16", "--batch", "8", "--write", str(out)]
    assert plan_main(argv) == 0
    written = yaml.safe_load(out.read_text())
    assert set(written["placement"]["roles"]) == {"actor", "critic", "reference"}
    assert "reward" not in written


def test_plan_requires_a_critic_for_ppo(capsys):
    argv = ["--actor", "tiny", "--devices", "2", "--prompt-len", "8", "--response-len", "8", "--batch", "4"]
    assert plan_main(argv) == 2
    assert "--critic is required for --algorithm ppo" in capsys.readouterr().err


def test_calibrate_writes_a_profile_that_the_planner_loads_as_cpu_local(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path))
    assert calibrate_main(["--quick"]) == 0
    assert "wrote" in capsys.readouterr().out
    profile = load_hardware("cpu-local")
    assert profile.compute_dtype == "fp32" and profile.compute_units_per_node >= 1
    # a 2-core VM does more than 1 GFLOP/s and 0.1 GB/s in one thread; gloo moves more than 1 MB/s
    assert profile.peak_flops > 1e9 and profile.memory_bandwidth > 1e8 and profile.intra_node_bandwidth > 1e6
    assert 0 < profile.intra_node_latency_s < 1.0
    # the fixed costs per call: a no-op call through Ray takes some time, none of them a second
    from hybridflow.mapping.hardware import FIXED_COST_FIELDS

    assert profile.controller_call_overhead_s > 0
    assert all(0 <= getattr(profile, field) < 1.0 for field in (*FIXED_COST_FIELDS, "decode_host_seconds_per_sequence"))
    from hybridflow.device import CPU_BF16_MIN_HIDDEN, cpu_has_native_bf16

    # the bf16 rate only where the cores multiply bf16 in hardware (where engine.dtype auto uses it)
    if cpu_has_native_bf16():
        assert profile.cpu_bf16_peak_flops > 1e9 and profile.cpu_bf16_min_hidden == CPU_BF16_MIN_HIDDEN
    else:
        assert profile.cpu_bf16_peak_flops is None
    assert plan_main(TINY_PPO + ["--devices", "4", "--per-node", "4", "--hardware", "cpu-local"]) == 0
    assert "cpu-local" in capsys.readouterr().out


def test_mapping_package_imports_neither_torch_nor_ray():
    import subprocess
    import sys

    code = "import sys, hybridflow.mapping, hybridflow.mapping.cli; print('torch' in sys.modules, 'ray' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]


def _auto_config(*overrides: str):
    from hybridflow.trainers.config.rl import load_rl_config

    return load_rl_config(None, ["data.train_path=train.jsonl", "actor.model.builtin=arithmetic",
                                 "reward.model.builtin=arithmetic", "placement.pools={cluster: [4]}",
                                 "placement.mapping=auto", "batch.prompts_per_step=16", "batch.mini_batch_size=16",
                                 *overrides])


def test_auto_mapping_with_local_hardware_refuses_until_calibrate_has_run_then_uses_the_measured_profile(
        tmp_path, monkeypatch):
    import hybridflow.device
    from hybridflow.mapping.hardware import HardwareProfile
    from hybridflow.trainers.auto_mapping import hardware_of, resolve_auto_mapping

    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path))
    monkeypatch.setattr(hybridflow.device, "device_type", lambda: "cpu")
    config = _auto_config()
    assert config.placement.hardware == "local"  # the default: never another machine's numbers silently
    with pytest.raises(ValueError, match=r"placement.hardware='local'.*'cpu-local'.*run `hybridflow calibrate`"):
        resolve_auto_mapping(config)
    measured = HardwareProfile(**(load_hardware("a100-80g").to_dict() | {"name": "cpu-local", "peak_flops": 1e11}))
    measured.save(tmp_path / "hardware" / "cpu-local.json")
    assert hardware_of(config) == load_hardware("cpu-local")
    assert hardware_of(config).peak_flops == 1e11
    resolved, plan_used = resolve_auto_mapping(config)
    assert plan_used is not None and resolved.placement.mapping == "manual"
    assert hardware_of(_auto_config("placement.hardware=h100-80g")).name == "h100-80g"
