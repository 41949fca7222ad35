"""How a command reaches a host: directly (this machine), through a command prefix that execs
its arguments elsewhere (`ip netns exec NS`, `nsenter ...`), or over SSH.

    role_command(host, argv, run_dir, name) -> (argv to run here, signal_argv)

For local and prefix hosts the process we start *is* the role (env and the prefix both exec),
so it is signalled directly and signal_argv is empty. Over SSH the process here is the ssh
client; the remote shell writes its PID to `run_dir/name.pid` before it execs the role, and
signal_argv is `ssh HOST kill -{signal} $(cat that file)`.

Secrets never go on a command line (ps shows those, here and on the far side). Locally and
through a prefix they are in the started process's environment (ProcessSpec.env). Over SSH,
`stdin_env` names variables the remote shell reads first, one line each, from its stdin with
the `read` builtin (no process is started for it) and exports; then `stdin_files` names files
it writes, 0600 (umask 077), each from one more line of base64 (the cluster's TLS key and
certificates: deploy/cluster_ca.py). The launcher writes those lines on the ssh client's stdin
(ProcessSpec.stdin, see stdin_lines) and closes it.
"""

from __future__ import annotations

import base64
import shlex
import sys
from pathlib import Path

from deploy.topology import Host

SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=15")


def python_of(host: Host) -> str:
    if host.python:
        return host.python
    return "python3" if host.kind == "ssh" else sys.executable


def _env_argv(host: Host, extra_env: dict[str, str]) -> list[str]:
    pairs = {**extra_env, **dict(host.env)}
    argv = ["env"]
    if host.workdir:
        argv += ["-C", host.workdir]
    return argv + [f"{k}={v}" for k, v in pairs.items()]


def ssh_argv(host: Host, remote_command: str) -> list[str]:
    return ["ssh", *SSH_OPTIONS, *host.ssh_options, host.ssh or host.address, remote_command]


def host_command(host: Host, argv: list[str], extra_env: dict[str, str] | None = None
                 ) -> list[str]:
    """The command that runs `argv` (interpreter first) on `host`, in the host's environment."""
    full = _env_argv(host, extra_env or {}) + argv
    if host.kind == "ssh":
        return ssh_argv(host, shlex.join(full))
    return [*host.exec_prefix, *full]


def stdin_lines(values: tuple[str, ...], files: tuple[Path, ...]) -> bytes:
    """What role_command's remote shell reads: each value, then each file as base64."""
    lines = [*values, *(base64.b64encode(f.read_bytes()).decode() for f in files)]
    return "".join(f"{line}\n" for line in lines).encode()


def role_command(host: Host, argv: list[str], run_dir: str, name: str,
                 extra_env: dict[str, str] | None = None, stdin_env: tuple[str, ...] = (),
                 stdin_files: tuple[str, ...] = ()) -> tuple[list[str], tuple[str, ...]]:
    """(command to start the role, command that signals it: see the module docstring)."""
    if host.kind != "ssh":
        return host_command(host, argv, extra_env), ()
    pid_file = f"{run_dir}/{name}.pid"
    reads = "".join(f"IFS= read -r {v} && export {v} && " for v in stdin_env)
    if stdin_files:
        folders = sorted({str(Path(f).parent) for f in stdin_files})
        reads += f"umask 077 && mkdir -p {' '.join(map(shlex.quote, folders))} && " + "".join(
            f"IFS= read -r line && printf %s \"$line\" | base64 -d > {shlex.quote(f)} && "
            for f in stdin_files)
    remote = (f"mkdir -p {shlex.quote(run_dir)} && echo $$ > {shlex.quote(pid_file)} && {reads}exec "
              + shlex.join(_env_argv(host, extra_env or {}) + argv))
    signal = f"kill -{{signal}} \"$(cat {shlex.quote(pid_file)})\""
    return ssh_argv(host, remote), tuple(ssh_argv(host, signal))
