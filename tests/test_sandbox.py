"""Tool code runs without network, within time, memory and output limits (dora_hpc/envs/sandbox.py)."""

import pytest

from dora_hpc.envs.sandbox import SandboxError, run_python


def run(code, **kw):
    try:
        return run_python(code, **kw)
    except SandboxError as e:  # no network namespace on this machine: nothing may run
        pytest.skip(str(e))


def test_code_runs_and_prints():
    r = run("print(6 * 7)")
    assert (r.stdout, r.exit_code, r.timed_out, r.truncated) == ("42\n", 0, False, False)


def test_there_is_no_network():
    r = run("import socket\nsocket.create_connection(('10.0.0.1', 80), timeout=2)")
    assert r.exit_code == 1 and "Network is unreachable" in r.stderr, r


def test_a_loop_is_killed_at_the_time_limit():
    r = run("while True: pass", timeout_s=1.0)
    assert r.timed_out and r.exit_code is None


def test_memory_is_capped():
    r = run("x = bytearray(2 * 1024 ** 3)", mem_mb=256)
    assert r.exit_code == 1 and "MemoryError" in r.stderr


def test_output_is_cut_at_the_cap():
    r = run("while True: print('x' * 100)", timeout_s=10, max_output=1000)
    assert r.truncated and len(r.stdout) <= 1000 and not r.timed_out  # stopped by the cap, not the clock
    assert "File too large" in r.stderr


def test_the_environment_and_the_directory_are_its_own():
    r = run("import os, sys; print(os.getcwd()); print(sorted(os.environ)); print(sys.flags.isolated)")
    cwd, env, isolated = r.stdout.splitlines()
    assert "dora-tool-" in cwd and env == "['LANG', 'PATH']" and isolated == "1"
