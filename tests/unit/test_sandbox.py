"""The sandboxed Python tool (rlhf_orch/rollout/sandbox.py; issue #29), run for real: real subprocesses, the audit
hook, the rlimits, the network namespace where this machine has one; no mocks."""
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlhf_orch.rollout.multiturn import ToolError
from rlhf_orch.rollout.sandbox import PythonSandbox, netns_prefix


def block(code: str) -> str:
    return f"Let me compute.\n```python\n{code}\n```\n"


def error_of(obs: str) -> str:
    assert "<error>\n" in obs, obs
    return obs.split("<error>\n", 1)[1].split("\n</error>", 1)[0]


@pytest.fixture(scope="module")
def sandbox():
    return PythonSandbox(timeout_s=2)


@pytest.fixture
def listener():
    """A socket listening on 127.0.0.1 (no connection may reach it)."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        srv.setblocking(False)
        yield srv
        with pytest.raises(BlockingIOError):   # nothing connected
            srv.accept()


# ---------------------------------------------------------------- calls and observations

def test_a_correct_program_answers_its_stdout(sandbox):
    assert sandbox(block("print(2 + 2)")) == "<output>\n4\n</output>\n"
    assert sandbox(block("x = 1")) == "<output>\n</output>\n"
    assert sandbox(block("import sys; sys.stdout.write('no newline')")) == "<output>\nno newline\n</output>\n"
    code = ("from dataclasses import dataclass\n@dataclass\nclass P:\n    x: int\n"
            "if __name__ == '__main__':\n    print('π ≈', P(3))")
    assert sandbox(block(code)) == "<output>\nπ ≈ P(x=3)\n</output>\n"


def test_no_block_is_no_call_and_the_last_block_runs(sandbox):
    assert sandbox("just text, no code") is None
    assert sandbox("```\nprint(1)\n```") is None                # no language: no call
    assert sandbox("```python\nprint(1)") is None               # unclosed: no call
    assert sandbox(block("print(1)") + "then\n" + block("print(2)")) == "<output>\n2\n</output>\n"


def test_the_standard_library_imports(sandbox):
    code = ("import json, math, fractions, statistics, decimal, itertools, re, collections, asyncio, logging\n"
            "print(json.dumps([math.isqrt(17), str(fractions.Fraction(1, 3) * 3), statistics.mean([1, 2, 3])]))")
    assert sandbox(block(code)) == '<output>\n[4, "1", 2]\n</output>\n'


def test_a_traceback_answers_its_last_line(sandbox):
    obs = sandbox(block("print('before')\nx = {}\nx['missing']"))
    assert obs.startswith("<output>\nbefore\n</output>\n")
    assert error_of(obs) == "KeyError: 'missing'"
    assert error_of(sandbox(block("def f(:\n    pass"))) == "SyntaxError: invalid syntax"
    # warnings printed at exit do not hide the exception
    assert error_of(sandbox(block("import warnings\nwarnings.warn('late')\n1 / 0"))) == \
        "ZeroDivisionError: division by zero"


def test_exit_status_and_exit_message(sandbox):
    assert error_of(sandbox(block("exit(3)"))) == "exit status 3"
    assert error_of(sandbox(block("import sys; sys.exit('giving up')"))) == "giving up"
    assert "<error>" not in sandbox(block("import sys; sys.exit(0)"))


def test_empty_or_too_long_code_raises_tool_error():
    tool = PythonSandbox(max_code_chars=50)
    for text in ("```python\n\n```", "```python\n   \n\n```"):
        with pytest.raises(ToolError, match="empty"):
            tool(text)
    with pytest.raises(ToolError, match="longer than 50"):
        tool(block("print(1)\n" * 10))


def test_output_is_truncated_with_a_marker():
    obs = PythonSandbox(max_output_chars=100)(block("print('a' * 60 + 'b' * 5000 + 'c' * 60)"))
    assert obs.startswith("<output>\n" + "a" * 50 + "\n[... output truncated: 5121 bytes in all ...]\n")
    assert obs.endswith("c" * 49 + "\n</output>\n") and len(obs) < 200


def test_environment_is_minimal_and_the_folder_is_removed(sandbox, monkeypatch):
    monkeypatch.setenv("http_proxy", "http://proxy:3128")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    obs = sandbox(block("import os, sys; print(sorted(os.environ)); print(os.getcwd()); print(sys.path)"))
    env, cwd, path = obs.split("\n")[1:4]
    assert env == "['HOME', 'LC_ALL', 'PATH', 'TMPDIR']"
    assert os.path.basename(cwd) == "work" and not os.path.exists(os.path.dirname(cwd))
    assert "/elsewhere" not in path and "site-packages" not in path


# ---------------------------------------------------------------- limits

def test_an_infinite_loop_times_out_and_leaves_no_process():
    tool = PythonSandbox(timeout_s=1)
    start = time.monotonic()
    obs = tool(block("import os\nprint(os.getpid(), os.getpgid(0))\nwhile True:\n    pass"))
    assert time.monotonic() - start < 1 + 2
    assert error_of(obs) == "timed out after 1 s"
    pid, pgid = map(int, obs.split("\n")[1].split())
    assert pid == pgid   # its own group, killed whole
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def test_cpu_limit():
    start = time.monotonic()
    obs = PythonSandbox(timeout_s=20, cpu_s=1)(block("while True:\n    pass"))
    assert error_of(obs) == "CPU time limit exceeded (1 s)" and time.monotonic() - start < 5


def test_a_memory_bomb_is_a_memory_error(sandbox):
    assert error_of(sandbox(block("x = bytearray(2 * 1024 ** 3)"))) == "MemoryError"
    assert error_of(sandbox(block("x = [0] * 10 ** 9"))) == "MemoryError"


def test_file_size_limit_also_caps_a_flood_of_output():
    tool = PythonSandbox(timeout_s=5, max_file_bytes=1 << 20)
    assert "File too large" in error_of(tool(block("open('big', 'wb').write(b'x' * (2 << 20))")))
    start = time.monotonic()
    obs = tool(block("while True:\n    print('y' * 1000)"))
    assert "File too large" in error_of(obs) and time.monotonic() - start < 4
    assert "[... output truncated: 104" in obs   # the stdout file stopped at 1 MiB


def test_threads_still_start_under_the_process_limit(sandbox):
    code = ("import threading\nout = []\nts = [threading.Thread(target=out.append, args=(i,)) for i in range(8)]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]\nprint(sorted(out))")
    assert sandbox(block(code)) == "<output>\n[0, 1, 2, 3, 4, 5, 6, 7]\n</output>\n"


# ---------------------------------------------------------------- files, processes, network

def test_files_inside_the_working_folder_work(sandbox):
    code = ("import os, pathlib\nos.mkdir('d')\npathlib.Path('d/a.txt').write_text('hi')\n"
            "os.rename('d/a.txt', 'd/b.txt')\nprint(open('d/b.txt').read(), os.listdir('d'))\n"
            "import shutil\nshutil.copytree('d', 'e')\nshutil.rmtree('d')\nprint(os.listdir('.'), os.listdir('e'))")
    assert sandbox(block(code)) == "<output>\nhi ['b.txt']\n['e'] ['b.txt']\n</output>\n"


def test_files_outside_are_refused(sandbox, tmp_path):
    outside = tmp_path / "outside.txt"
    obs = sandbox(block(f"open({str(outside)!r}, 'w').write('x')"))
    assert error_of(obs).startswith("PermissionError: sandbox: write access") and not outside.exists()
    assert error_of(sandbox(block("print(open('/etc/passwd').read())"))).startswith(
        "PermissionError: sandbox: read access to '/etc/passwd'")
    assert "PermissionError" in error_of(sandbox(block("open('../main.py', 'w')")))   # the code's file, above cwd


@pytest.mark.parametrize("code", [
    "import subprocess\nsubprocess.run(['ls'])",
    "import os\nos.fork()",
    "import os\nos.system('ls')",
    "import os\nos.execv('/bin/ls', ['ls'])",
    "import os\nos.posix_spawn('/bin/ls', ['ls'], {})",
    "import ctypes",
    "import _posixsubprocess\n_posixsubprocess.fork_exec(1, 2, 3)",
    "import os\nos.kill(1, 0)",
    "import os\nos.symlink('/etc/passwd', 'p')",
    "import os\nos.listdir('/')",
    "import os\nos.chdir('/')",
    "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
])
def test_processes_and_escapes_are_refused(sandbox, code):
    assert error_of(sandbox(block(code))).startswith("PermissionError: sandbox: ")


@pytest.mark.parametrize("use_netns", [False, None])   # the audit hook alone; with the namespace where it works
def test_a_connection_to_a_listening_socket_is_refused(listener, use_netns):
    port = listener.getsockname()[1]
    obs = PythonSandbox(use_netns=use_netns)(block(f"import socket\nsocket.create_connection(('127.0.0.1', {port}))"))
    assert error_of(obs).startswith("PermissionError: sandbox: socket.")


def test_the_network_namespace_layer_cuts_the_network_by_itself(listener):
    prefix = netns_prefix()
    if not prefix:
        pytest.skip("no network namespace on this machine (unshare unavailable or not permitted)")
    port = listener.getsockname()[1]
    r = subprocess.run([*prefix, sys.executable, "-I", "-c",
                        f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "OSError" in r.stderr


# ---------------------------------------------------------------- threads

def test_parallel_calls_from_threads(sandbox):
    codes = [f"import os, time\ntime.sleep(0.1)\nprint({i} * {i}, os.getcwd())" for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        obs = list(pool.map(lambda c: sandbox(block(c)), codes))
    lines = [o.split("\n")[1].split() for o in obs]
    assert [int(v) for v, _ in lines] == [i * i for i in range(8)]
    assert len({cwd for _, cwd in lines}) == 8   # each call its own folder
