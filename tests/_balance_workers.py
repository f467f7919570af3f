"""Functions the balancing tests run on several ranks (spawn needs importable names)."""

from __future__ import annotations

import torch


def choose_everything() -> dict[str, list[str]]:
    """Every balance method on the tied GPT, 4 stages; "time" inside a gloo process group."""
    import torch.distributed as dist

    from pipedialect import partition
    from pipedialect.cost.balance import choose_split_points
    from pipedialect.models import TinyGPT

    torch.set_num_threads(1)
    model = TinyGPT()
    example = {
        "input_ids": torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    }
    chosen = {
        method: choose_split_points(model, 4, method, example_inputs=example, micro_batches=4)
        for method in ("parameters", "flops", "memory")
    }
    chosen["fx-parameters"] = choose_split_points(model, 4, "parameters")
    dist.init_process_group("gloo")
    try:
        chosen["time"] = choose_split_points(model, 4, "time", example_inputs=example)
    finally:
        dist.destroy_process_group()
    for points in chosen.values():
        partition(model, points)
    return chosen
