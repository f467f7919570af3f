"""Run Python programs as ``python PROGRAM`` or ``torchrun --nproc_per_node N PROGRAM`` runs
them, each process forked from this one, which imported torch once (about 2 CPU-seconds a
fresh interpreter spends again).

Started as a script (``python tests/_fork_runner.py``). Each line on stdin is a JSON request
``{"program": ..., "cwd": ..., "stdout": ..., "stderr": ...}``, with ``"nproc": N`` and
``"master_port": P`` for a torchrun program. For each, a child is forked per process that
changes to ``cwd``, sends its stdout and stderr to those files (``<file>.<rank>`` per rank of a
torchrun program), reads stdin from ``/dev/null``, sets ``sys.argv`` and ``sys.path[0]`` as
``python PROGRAM`` does, and runs the program as ``__main__`` in a namespace of its own. A
torchrun program's ranks get the variables torchrun gives its workers (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``,
``ROLE_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``), rank 0 holding
the rendezvous store (torchrun's own agent is not there); as under torchrun, the first rank
that fails ends the others. A child ends as an interpreter ends: an uncaught exception prints
its traceback and exits 1, ``sys.exit`` exits with its code, and the interpreter's
finalization (``atexit`` hooks included) runs. This process answers one JSON line per request,
``{"returncode": N}`` (negative: the signal that ended the child; for a torchrun program the
first failing rank's, else 0), and is never changed by what a program does: each child starts
from the state right after ``import torch``, never from another program's. Only torch is
imported here, so each program imports pipedialect (and everything else) itself, as in a
fresh interpreter. ``tests/project/test_quickstart.py`` runs the quickstart under torchrun
itself.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any

import torch  # noqa: F401  (the import every program makes, made once)


def _become(request: dict[str, Any]) -> None:
    """In the child: the process ``python PROGRAM`` would be, started in ``cwd`` with the
    request's ``env`` added to this process's environment."""
    program = request["program"]
    os.environ.update(request.get("env", {}))
    os.chdir(request["cwd"])
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(os.devnull)  # noqa: SIM115  (the process's stdin until it ends)
    sys.argv = [program]
    sys.path[0] = str(Path(program).resolve().parent)


def _rank_request(request: dict[str, Any], rank: int, nproc: int) -> dict[str, Any]:
    """Rank ``rank``'s part of a torchrun request: its own output files and variables."""
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(request["master_port"]),
        "TORCHELASTIC_RUN_ID": "none",
    }
    return {
        **request,
        "env": env,
        "stdout": f"{request['stdout']}.{rank}",
        "stderr": f"{request['stderr']}.{rank}",
    }


def _start(request: dict[str, Any]) -> int:
    """Fork the child that runs ``request``'s program; its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _become(request)
        # Raised out of main(): the interpreter prints an uncaught exception and ends as
        # ``python PROGRAM`` would.
        runpy.run_path(request["program"], run_name="__main__")
        sys.exit(0)
    return pid


def _run(request: dict[str, Any]) -> int:
    """Run one request's program, in one process or ``nproc`` ranks; its return code."""
    nproc = int(request.get("nproc", 0))
    if not nproc:
        _, status = os.waitpid(_start(request), 0)
        return os.waitstatus_to_exitcode(status)
    running = [_start(_rank_request(request, rank, nproc)) for rank in range(nproc)]
    returncode = 0
    while running:
        pid, status = os.wait()
        running.remove(pid)
        code = os.waitstatus_to_exitcode(status)
        if code and not returncode:  # the first failure ends the others, as under torchrun
            returncode = code
            for other in running:
                os.kill(other, signal.SIGTERM)
    return returncode


def main() -> None:
    for line in sys.stdin:
        returncode = _run(json.loads(line))
        print(json.dumps({"returncode": returncode}), flush=True)


if __name__ == "__main__":
    main()
