"""The code sandbox as a security boundary: every escape of issue 15 and the usual runaway programs must fail.

Each test arranges something on the host that the escape would change (a marker file, a
listening socket, a live process, an environment variable) and checks it afterwards from the
host, so a sandbox that let the escape through would fail the test.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from hybridflow.rewards import (
    RuleReward,
    SandboxConfig,
    code_reward,
    run_python,
    sandbox,
    seccomp,
)

FAST = SandboxConfig(timeout_s=3.0)
pytestmark = pytest.mark.skipif(
    sandbox.isolation_problem(FAST.interpreter) is not None,
    reason=f"no OS sandbox here: {sandbox.isolation_problem(FAST.interpreter)}",
)


@pytest.fixture(autouse=True)
def always_isolated(monkeypatch):
    """The hostile programs below must never run outside the sandbox, whatever the environment says."""
    monkeypatch.delenv("HYBRIDFLOW_SANDBOX", raising=False)
    assert FAST.effective_isolation == "bwrap"


@pytest.fixture
def shared_dir(tmp_path):
    """A host directory anyone may write to: only the sandbox's walls keep the guest out of it."""
    tmp_path.chmod(0o777)
    return tmp_path


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_the_audit_hook_exploit_of_issue_15_cannot_touch_the_host(shared_dir):
    marker = shared_dir / "marker"
    code = (
        "import sys\n"
        "try:\n"
        "    m = sys.modules['__main__']; m._FORBIDDEN_EVENTS.clear(); m._FORBIDDEN_PREFIXES = ('zzzz',)\n"
        "except Exception:\n"
        "    pass\n"
        "import subprocess\n"
        f"print(subprocess.run(['sh', '-c', 'id -u; echo pwned > {marker}'], capture_output=True, text=True))\n"
    )
    result = run_python(code, config=FAST)
    assert result.isolated
    assert not marker.exists()
    assert "stdout='65534\\n'" in result.stdout  # the shell ran, as nobody, inside the sandbox only


def test_the_guest_never_runs_as_root_inside_or_outside():
    code = (
        "import os\n"
        "print(os.getuid(), os.geteuid(), os.getgid(), os.getgroups())\n"
        "inside, outside, count = open('/proc/self/uid_map').read().split()[:3]\n"
        "print(int(outside) + os.getuid() - int(inside))\n"
        "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
    )
    result = run_python(code, config=FAST)
    ids, outside_uid, capabilities = result.stdout.splitlines()
    assert ids == "65534 65534 65534 []"
    assert int(outside_uid) != 0
    assert int(capabilities, 16) == 0
    assert code_reward("p", "import os\nprint(os.getuid())", tests=[{"input": "", "output": "0"}], sandbox=FAST) == 0.0


@pytest.mark.parametrize("loops_forever", [False, True], ids=["returns", "times_out"])
def test_no_process_outlives_the_run_not_even_with_setsid(loops_forever):
    marker = f"{uuid.uuid4().int % 10**6}.{uuid.uuid4().int % 10**6}"
    code = (
        "import os, subprocess, _posixsubprocess\n"
        f"subprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
        "print('spawned', flush=True)\n"
        + ("while True:\n    pass\n" if loops_forever else "")
    )
    result = run_python(code, config=SandboxConfig(timeout_s=2.0))
    assert result.stdout == "spawned\n" and result.timed_out == loops_forever
    assert _processes_with(marker) == []


def test_files_outside_the_scratch_directory_cannot_be_created_or_changed(shared_dir):
    victim = shared_dir / "victim.txt"
    victim.write_text("precious")
    victim.chmod(0o666)
    host_tmp_marker = Path("/tmp") / f"hybridflow-escape-{uuid.uuid4().hex}"
    attempts = {
        "write": f"open({str(victim)!r}, 'w').write('gone')",
        "remove": f"os.remove({str(victim)!r})",
        "mkfifo": f"os.mkfifo({str(shared_dir / 'fifo')!r})",
        "sqlite": f"import sqlite3; sqlite3.connect({str(shared_dir / 'db.sqlite')!r}).execute('create table t(x)')",
        "setxattr": f"os.setxattr({str(victim)!r}, 'user.pwned', b'1')",
        "symlink": f"os.symlink('/etc/passwd', {str(shared_dir / 'link')!r})",
        "tmp": f"open({str(host_tmp_marker)!r}, 'w').write('x')",
        "root_fs": "open('/pwned', 'w').write('x')",
        "usr": "open('/usr/pwned', 'w').write('x')",
        "inputs": "open('/sandbox/in/pwned', 'w').write('x')",
    }
    code = "import os\n" + "".join(
        f"try:\n    {line}\n    print('ESCAPED {name}')\nexcept Exception as error:\n    print('{name}', type(error).__name__)\n"
        for name, line in attempts.items()
    ) + "open('scratch.txt', 'w').write('ok')\nprint('scratch', open('scratch.txt').read(), os.getcwd())\n"
    result = run_python(code, config=FAST)
    assert result.ok, result.stderr
    assert "ESCAPED" not in result.stdout, result.stdout
    assert "scratch ok /sandbox/work" in result.stdout
    assert victim.read_text() == "precious"
    assert sorted(path.name for path in shared_dir.iterdir()) == ["victim.txt"]
    assert "user.pwned" not in os.listxattr(victim)
    assert not host_tmp_marker.exists() and not Path("/pwned").exists() and not Path("/usr/pwned").exists()


def test_network_is_unreachable_over_tcp_udp_and_unix_sockets(shared_dir):
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract_name = f"\0hybridflow-test-{uuid.uuid4().hex}"
    unix_path = str(shared_dir / "host.sock")
    try:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen(8)
        udp.bind(("127.0.0.1", 0))
        unix.bind(unix_path)
        os.chmod(unix_path, 0o777)
        unix.listen(8)
        abstract.bind(abstract_name)
        abstract.listen(8)
        attempts = {
            "tcp": f"s = socket.create_connection(('127.0.0.1', {tcp.getsockname()[1]}), timeout=1)",
            "udp": f"socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {udp.getsockname()[1]}))",
            "unix": f"socket.socket(socket.AF_UNIX).connect({unix_path!r})",
            "abstract": f"socket.socket(socket.AF_UNIX).connect({abstract_name!r})",
            "docker": "socket.socket(socket.AF_UNIX).connect('/var/run/docker.sock')",
        }
        code = "import socket\n" + "".join(
            f"try:\n    {line}\n    print('ESCAPED {name}')\nexcept Exception as error:\n    print('{name}', error)\n"
            for name, line in attempts.items()
        )
        result = run_python(code, config=FAST)
        assert result.ok and "ESCAPED" not in result.stdout, (result.stdout, result.stderr)
        for listener in (tcp, udp, unix, abstract):
            listener.setblocking(False)
        for listener in (tcp, unix, abstract):
            with pytest.raises(BlockingIOError):
                listener.accept()
        with pytest.raises(BlockingIOError):
            udp.recv(16)
    finally:
        for listener in (tcp, udp, unix, abstract):
            listener.close()


def test_the_guest_cannot_read_the_trainers_environment(monkeypatch):
    secret = f"hunter-{uuid.uuid4().hex}"
    monkeypatch.setenv("HYBRIDFLOW_TEST_SECRET", secret)
    code = (
        "import os, glob\n"
        "print(dict(os.environ))\n"
        f"for path in glob.glob('/proc/*/environ') + ['/proc/{os.getpid()}/environ', '/proc/{os.getppid()}/environ']:\n"
        "    try:\n"
        "        print(path, open(path, 'rb').read())\n"
        "    except OSError as error:\n"
        "        print(path, error)\n"
    )
    result = run_python(code, config=FAST)
    assert result.ok, result.stderr
    assert "/proc/1/environ" in result.stdout  # it did look
    assert secret not in result.stdout + result.stderr


def test_the_guest_cannot_signal_other_processes():
    victims = [subprocess.Popen(["sleep", "60"])]
    if os.geteuid() == 0:  # a process of the very uid the guest runs as
        victims.append(subprocess.Popen(["sleep", "60"], user=65534, group=65534, extra_groups=[]))
    try:
        pids = [victim.pid for victim in victims]
        code = (
            "import os, signal\n"
            f"for pid in {pids}:\n"
            "    for attempt in (lambda: os.kill(pid, 9), lambda: os.killpg(pid, 9),\n"
            "                    lambda: signal.pidfd_send_signal(os.pidfd_open(pid), 9)):\n"
            "        try:\n"
            "            attempt(); print('ESCAPED', pid)\n"
            "        except OSError as error:\n"
            "            print(pid, error)\n"
        )
        result = run_python(code, config=FAST)
        assert "ESCAPED" not in result.stdout, result.stdout
        assert [victim.poll() for victim in victims] == [None] * len(victims)
    finally:
        for victim in victims:
            victim.kill()
            victim.wait()


def test_ordinary_programs_still_work_threads_process_pools_asyncio_and_temp_files():
    code = (
        "import asyncio, concurrent.futures, os, tempfile, threading\n"
        "results = []\n"
        "thread = threading.Thread(target=lambda: results.append('thread')); thread.start(); thread.join()\n"
        "with concurrent.futures.ProcessPoolExecutor(2) as pool:\n"
        "    results.append(sum(pool.map(abs, [-1, -2])))\n"
        "results.append(asyncio.run(asyncio.sleep(0, result='async')))\n"
        "with tempfile.TemporaryDirectory() as directory:\n"
        "    open(os.path.join(directory, 'f'), 'w').write('x')\n"
        "    results.append(os.path.dirname(directory))\n"
        "print(results)\n"
    )
    result = run_python(code, config=SandboxConfig(timeout_s=20.0))
    assert result.ok, result.stderr
    assert result.stdout == "['thread', 3, 'async', '/sandbox/work']\n"


def test_runaway_code_is_killed_at_the_time_limit():
    result = run_python("while True:\n    pass\n", config=SandboxConfig(timeout_s=1.0))
    assert result.timed_out and not result.ok and result.returncode is not None
    assert code_reward("p", "while True: pass", tests=["assert True"], sandbox=SandboxConfig(timeout_s=1.0)) == 0.0


def test_a_fork_bomb_is_bounded_by_the_process_limit():
    code = (
        "import os, time\n"
        "count = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    count += 1\n"
        "print(count)\n"
    )
    result = run_python(code, config=SandboxConfig(timeout_s=5.0, max_processes=8))
    assert result.ok, result.stderr
    assert 0 <= int(result.stdout) < 8


def test_a_memory_bomb_hits_the_memory_limit_not_the_host():
    result = run_python("blocks = []\nwhile True:\n    blocks.append(bytearray(10**8))\n", config=FAST)
    assert result.returncode == 1 and "MemoryError" in result.stderr


def test_filling_the_scratch_directory_stops_at_its_size():
    code = "f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 65536)\n"
    result = run_python(code, config=SandboxConfig(timeout_s=3.0, scratch_mb=2, max_output_bytes=10**8))
    assert result.returncode == 1 and "No space left on device" in result.stderr


def test_an_output_flood_is_capped():
    result = run_python("while True:\n    print('x' * 1000)\n", config=SandboxConfig(timeout_s=2.0, max_output_bytes=10_000))
    assert not result.ok and len(result.stdout) <= 10_000


def test_a_crashing_program_only_fails_its_tests():
    assert run_python("import os\nos.abort()\n", config=FAST).returncode == 128 + 6  # bwrap's way to say SIGABRT
    assert code_reward("p", "raise SystemExit(3)", tests=["assert True"], sandbox=FAST) == 0.0


@pytest.mark.skipif(not seccomp.available(), reason="libseccomp is not installed")
def test_the_seccomp_filter_refuses_namespaces_tracing_and_inet_sockets():
    code = (
        "import ctypes, os, socket\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print('unshare', libc.unshare(0x10000000), ctypes.get_errno())\n"
        "print('ptrace', libc.ptrace(16, 1, 0, 0), ctypes.get_errno())\n"
        "try:\n"
        "    socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
        "except OSError as error:\n"
        "    print('inet', error.errno)\n"
        "socket.socketpair()\n"
        "print(open('/proc/self/status').read().split('Seccomp:')[1].split()[0])\n"
    )
    result = run_python(code, config=FAST)
    assert result.ok, result.stderr
    assert result.stdout.splitlines() == ["unshare -1 1", "ptrace -1 1", "inet 13", "2"]


def test_without_bubblewrap_code_rewards_refuse_to_run_unless_the_user_opts_out(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    sandbox.isolation_problem.cache_clear()
    try:
        with pytest.raises(sandbox.SandboxUnavailableError, match="apt-get install bubblewrap"):
            run_python("print(1)", config=FAST)
        with pytest.raises(ValueError, match="reward function 'code' cannot run here: .*bubblewrap"):
            RuleReward("code")  # reported when the reward is built, before any model loads
        sandbox._warn_unisolated.cache_clear()
        with pytest.warns(UserWarning, match="WITHOUT operating-system isolation"):
            result = run_python("print(1)", config=SandboxConfig(isolation="none"))
        assert result.ok and result.stdout == "1\n" and not result.isolated
        monkeypatch.setenv("HYBRIDFLOW_SANDBOX", "none")
        assert run_python("print(2)", config=FAST).stdout == "2\n"
        assert RuleReward("code").name == "code"
        monkeypatch.setenv("HYBRIDFLOW_SANDBOX", "off")
        with pytest.raises(ValueError, match="HYBRIDFLOW_SANDBOX must be one of"):
            run_python("print(3)", config=FAST)
    finally:
        sandbox.isolation_problem.cache_clear()


def test_the_sandbox_costs_well_under_a_second_per_call():
    start = time.monotonic()
    result = run_python("print('ok')", config=FAST)
    assert result.ok and result.stdout == "ok\n"
    assert time.monotonic() - start < FAST.timeout_s


def test_an_interpreter_outside_a_prefix_of_its_own_is_refused_not_mounted_with_the_whole_root():
    config = SandboxConfig(python_executable="/python3")  # its "prefix" would be / itself
    with pytest.raises(sandbox.SandboxUnavailableError, match="python_executable '/python3' lives under '/', too broad"):
        run_python("print(1)", config=config)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"timeout_s": 0}, "timeout_s"), ({"memory_mb": 8}, "memory_mb"), ({"max_output_bytes": 10}, "max_output_bytes"),
     ({"max_processes": 0}, "max_processes"), ({"scratch_mb": 0}, "scratch_mb"), ({"isolation": "off"}, "isolation")],
)
def test_sandbox_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SandboxConfig(**kwargs)


def _install_sandbox(bin_dir: Path) -> subprocess.CompletedProcess:
    script = Path(__file__).parents[1] / "scripts" / "install_sandbox.sh"
    (bin_dir / "id").symlink_to(subprocess.run(["which", "id"], capture_output=True, text=True, check=True).stdout.strip())
    return subprocess.run(["/bin/bash", str(script)], capture_output=True, text=True, check=False, env={"PATH": str(bin_dir)})


def test_the_install_script_warns_but_succeeds_without_apt_or_bubblewrap(tmp_path):
    result = _install_sandbox(tmp_path)  # a PATH with neither bwrap nor apt-get
    assert result.returncode == 0
    assert result.stderr.startswith("warning: bubblewrap (bwrap) is not installed; code rewards will refuse to run")


@pytest.mark.skipif(os.geteuid() != 0, reason="the script installs only as root")
@pytest.mark.parametrize("apt_works", [True, False])
def test_the_install_script_installs_bubblewrap_with_apt_as_root(tmp_path, apt_works):
    fake_apt = tmp_path / "apt-get"
    creates_bwrap = f"printf '#!/bin/sh\\n' > {tmp_path}/bwrap; /bin/chmod +x {tmp_path}/bwrap; " if apt_works else ""
    fake_apt.write_text(f"#!/bin/sh\nif [ \"$1\" = install ]; then {creates_bwrap}exit {0 if apt_works else 100}; fi\n")
    fake_apt.chmod(0o755)
    result = _install_sandbox(tmp_path)
    assert result.returncode == 0
    if apt_works:
        assert result.stdout == "installed bubblewrap for the code-reward sandbox\n" and (tmp_path / "bwrap").exists()
    else:
        assert "warning: apt-get could not install bubblewrap" in result.stderr
