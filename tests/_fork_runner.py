"""Run Python programs as ``python PROGRAM`` runs them, each in a process of its own forked from
this one, which imported torch once (about 2 CPU-seconds a fresh interpreter spends again).

Started as a script (``python tests/_fork_runner.py``). Each line on stdin is a JSON request
``{"program": ..., "cwd": ..., "stdout": ..., "stderr": ...}``; for each, a child is forked that
changes to ``cwd``, sends its stdout and stderr to those files, reads stdin from ``/dev/null``,
sets ``sys.argv`` and ``sys.path[0]`` as ``python PROGRAM`` does, and runs the program as
``__main__`` in a namespace of its own. The child ends as an interpreter ends: an uncaught
exception prints its traceback and exits 1, ``sys.exit`` exits with its code, and the
interpreter's finalization (``atexit`` hooks included) runs. This process answers one JSON line
per request, ``{"returncode": N}`` (negative: the signal that ended the child), and is never
changed by what a program does: each child starts from the state right after ``import torch``,
never from another program's. Only torch is imported here, so each program imports pipedialect
(and everything else) itself, as in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import torch  # noqa: F401  (the import every program makes, made once)


def _become(request: dict[str, str]) -> None:
    """In the child: the process ``python PROGRAM`` would be, started in ``cwd``."""
    program = request["program"]
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


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _become(request)
            # Raised out of main(): the interpreter prints an uncaught exception and ends as
            # ``python PROGRAM`` would.
            runpy.run_path(request["program"], run_name="__main__")
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
