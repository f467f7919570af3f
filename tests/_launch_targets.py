"""Module-level functions the launcher tests run on several ranks (spawn needs importable names)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def report_env() -> dict[str, str]:
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "OMP_NUM_THREADS", "EXTRA")
    return {k: os.environ.get(k, "") for k in keys}


def report_start() -> dict[str, object]:
    """What a rank inherited from the launching process: a variable, sys.path, the directory,
    and whether transformers, a module of pipedialect that a rank does not import and
    torch.export's tracer were imported before the rank started."""
    import sys

    preloaded = "transformers.trainer" in sys.modules
    mirrored = "pipedialect.models" in sys.modules
    tracer = "torch.export._trace" in sys.modules

    import torch

    return {
        "transformers": preloaded,
        "pipedialect": mirrored,
        "torch.export": tracer,
        "LATE": os.environ.get("LATE", ""),
        "path": list(sys.path),
        "cwd": str(Path.cwd()),
        "threads": torch.get_num_threads(),
    }


def all_reduce_rank() -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return float(t.item())


def fail_on_rank_one() -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise RuntimeError("stage exploded on purpose")
    t = torch.zeros(1)
    dist.recv(t, src=1)  # would wait forever: the launcher must stop this rank
    return 0


def sleep_forever() -> None:
    time.sleep(3600)


def chatter_then_fail() -> None:
    import sys

    import torch.distributed as dist

    print(f"chatter from rank {os.environ['RANK']}", flush=True)
    os.write(2, b"low-level stderr line\n")  # bypasses Python's sys.stderr
    dist.init_process_group("gloo")
    dist.barrier()  # both ranks have written their lines before rank 1 fails
    if os.environ["RANK"] == "1":
        sys.exit("rank 1 gives up")
    dist.barrier()  # rank 0 waits here until the launcher stops it


def nap_after_saying_so(ready_dir: str) -> None:
    """Leave a file named after this rank in ``ready_dir``, then sleep (until stopped)."""
    (Path(ready_dir) / os.environ["RANK"]).touch()
    time.sleep(3600)


def start_data_loader_workers(record: str, fail_rank: int | None) -> list[int]:
    """Start a ``DataLoader``'s worker processes, as DeepSpeed's loader does on every rank, and
    write the pids of every process this rank started to ``record/rank<r>``. Then return them,
    or raise on ``fail_rank`` while the other ranks wait, still holding their workers, until
    the launcher stops them."""
    import psutil
    import torch

    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    # From a fork server, as in a rank DeepSpeed's loader runs in: a worker watches its parent,
    # which is then the fork server, not the rank.
    loader = torch.utils.data.DataLoader(
        data, batch_size=2, num_workers=2, multiprocessing_context="forkserver"
    )
    batches = iter(loader)
    next(batches)  # the workers run now and stay for the next batch
    started = [p.pid for p in psutil.Process().children(recursive=True)]
    rank = int(os.environ["RANK"])
    Path(record, f"rank{rank}").write_text(" ".join(map(str, started)))
    if fail_rank is None:
        return started
    if rank == fail_rank:
        raise RuntimeError("failed on purpose")
    time.sleep(600)
    return started
