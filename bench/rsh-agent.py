#!/usr/bin/env python3
"""A remote-shell agent for mpirun between the launcher's VMs, which have
no sshd: every VM runs the server, and mpirun in one VM starts its daemons
(orted) in the others through the client, as it would through ssh.

    rsh-agent.py serve [--port 29513]           # in every VM, in the background
    mpirun --mca plm_rsh_agent /path/rsh-agent.py --host IP0,IP1 ...

As mpirun's agent, it is called as `rsh-agent.py HOST COMMAND...`: it asks
HOST's server to run COMMAND with /bin/sh, copies its output here and
exits with its status. No authentication: the VMs' network is private to
one job (bench/guest-p2p.py starts the server there; do not run it on a
network others reach). The port comes from DMLC_RSH_PORT (default 29513).
"""

from __future__ import annotations

import json
import os
import socket
import socketserver
import subprocess
import sys

PORT = int(os.environ.get("DMLC_RSH_PORT", "29513"))


class Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        request = json.loads(self.rfile.readline())
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        proc = subprocess.Popen(
            ["/bin/sh", "-c", request["command"]],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        assert proc.stdout is not None
        for chunk in iter(lambda: proc.stdout.read1(65536), b""):  # type: ignore[union-attr]
            self.wfile.write(b"o" + len(chunk).to_bytes(4, "big") + chunk)
        status = proc.wait()
        self.wfile.write(b"x" + (status & 0xFF).to_bytes(4, "big"))


class Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


def serve(port: int) -> None:
    # Every interface: the peers reach it over the job's own network.
    with Server(("0.0.0.0", port), Handler) as server:
        server.serve_forever()


def run(host: str, command: str) -> int:
    with socket.create_connection((host, PORT), timeout=60) as s:
        s.settimeout(None)
        s.sendall(json.dumps({"command": command}).encode() + b"\n")
        f = s.makefile("rb")
        while True:
            kind = f.read(1)
            if not kind:
                print(f"rsh-agent: {host} closed the connection", file=sys.stderr)
                return 255
            n = int.from_bytes(f.read(4), "big")
            if kind == b"x":
                return n
            sys.stdout.buffer.write(f.read(n))
            sys.stdout.buffer.flush()


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["serve"]:
        port = int(args[2]) if args[1:2] == ["--port"] else PORT
        serve(port)
        return
    # mpirun may put ssh-style options first (-x, -T): skip them.
    while args and args[0].startswith("-"):
        args = args[1:]
    if len(args) < 2:
        raise SystemExit("usage: rsh-agent.py serve [--port P] | rsh-agent.py HOST COMMAND...")
    sys.exit(run(args[0], " ".join(args[1:])))


if __name__ == "__main__":
    main()
