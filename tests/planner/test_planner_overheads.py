"""What each parallel mode adds per computation: the calibration's fit and the cost model's
charge, against hand-computed values ([Note: calibration], [Note: cost model])."""

from __future__ import annotations

import math

import pytest
import torch
from _layouts import one_stage_layout

from pipedialect.cost import Atom, Chain, Cluster, model_chains, predict
from pipedialect.models import MHGPT_TENSOR_PLAN, MultiHeadGPT
from pipedialect.planner import build_program
from pipedialect.planner._calibrate import Calibration, computations, mode_overheads


@pytest.mark.parametrize("m", [1, 2, 6])
def test_one_stage_runs_a_forward_and_a_backward_per_micro_batch(m: int) -> None:
    assert computations("1f1b", m) == 2 * m


def test_the_fit_gives_each_modes_cost_per_unit_and_per_sharded_module() -> None:
    """Steps made by hand: 50 ms per step, 1 ms per computation under DDP; FSDP adds 0.4 ms for
    each of its 5 units (4 blocks and the root); tensor parallelism 2.5 ms for each of its 8
    sharded modules (a column-wise and a row-wise layer per block). A step of m micro-batches
    runs 2 m computations."""

    def steps(per_computation: float) -> dict[int, float]:
        return {m: 0.05 + 2 * m * per_computation for m in (2, 6)}

    fitted = mode_overheads(
        "1f1b",
        {
            "ddp": steps(0.001),
            "fsdp": steps(0.001 + 5 * 0.0004),
            "tensor": steps(0.001 + 8 * 0.0025),
        },
        blocks=4,
    )
    assert math.isclose(fitted["fsdp_unit_overhead"], 0.0004, rel_tol=1e-9)
    assert math.isclose(fitted["tensor_module_overhead"], 0.0025, rel_tol=1e-9)
    # A mode not measured, or measured no dearer than DDP (load noise), costs nothing more.
    cheaper = mode_overheads("1f1b", {"ddp": steps(0.002), "fsdp": steps(0.001)}, blocks=4)
    assert cheaper == {"fsdp_unit_overhead": 0.0, "tensor_module_overhead": 0.0}


def test_a_sharded_stage_pays_its_units_and_a_tensor_stage_its_modules_per_computation() -> None:
    """One stage of two atoms, 3 blocks and 5 tensor-parallel modules in all; 1 s forward and 2 s
    backward per atom, nothing to communicate (no parameters). GPipe, 2 micro-batches: 4
    computations in a row, each 0.1 s of runtime plus, under FSDP, 0.01 s for each of its 4 units
    (3 blocks and the root), and at t = 2 0.02 s for each of its 5 sharded modules."""
    first = Atom(forward=1.0, backward=2.0, blocks=2, tensor_modules=3)
    second = Atom(forward=1.0, backward=2.0, blocks=1, tensor_modules=2)
    chain = Chain((first, second), ("a",), (4,))
    cluster = Cluster(
        world_size=2,
        memory_per_rank=1e9,
        bandwidth=1e12,
        action_overhead=0.1,
        fsdp_unit_overhead=0.01,
        tensor_module_overhead=0.02,
    )
    program = build_program("gpipe", 1, 2, 1)
    work = 2 * (2.0 + 4.0)
    ddp = predict(chain, one_stage_layout(data_parallel=2, micro_batches=2), cluster, program)
    assert math.isclose(ddp.step_time, work + 4 * 0.1)
    fsdp = predict(
        chain,
        one_stage_layout(data_parallel=2, data_parallel_mode="fsdp", micro_batches=2),
        cluster,
        program,
    )
    assert math.isclose(fsdp.step_time, work + 4 * (0.1 + 4 * 0.01))
    tensor = predict(chain, one_stage_layout(tensor_parallel=2, micro_batches=2), cluster, program)
    # The tensor-parallel part is none of the work here: only the per-module cost is added.
    assert math.isclose(tensor.step_time, work + 4 * (0.1 + 5 * 0.02))
    # Without tensor parallelism the modules cost nothing more.
    assert math.isclose(
        predict(chain, one_stage_layout(micro_batches=2), cluster, program).step_time,
        work + 4 * 0.1,
    )


def test_the_chain_counts_each_atoms_blocks_and_tensor_modules() -> None:
    """MultiHeadGPT of 4 blocks cut after its blocks: the first four atoms end one block each,
    the fifth (final norm and LM head) none; each block has 6 sharded modules (q, k, v, o, fc1,
    fc2), the first atom also the row-wise embedding and the last the column-wise LM head."""
    (chain,) = model_chains(
        MultiHeadGPT(),
        {"input_ids": torch.zeros(2, 8, dtype=torch.long)},
        tensor_parallel=MHGPT_TENSOR_PLAN,
        flops_per_second=1e9,
    ).values()
    assert chain.cuts == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    assert [a.blocks for a in chain.atoms] == [1, 1, 1, 1, 0]
    assert [a.tensor_modules for a in chain.atoms] == [7, 6, 6, 6, 1]
    (stage,) = chain.stages(())
    assert (stage.blocks, stage.tensor_modules) == (4, 26)


def test_a_stored_calibration_describes_and_carries_the_mode_costs() -> None:
    cal = Calibration(
        dialect="torch",
        machine="m",
        torch="t",
        world_size=2,
        action_overhead=0.001,
        step_overhead=0.0,
        latency=0.0,
        bandwidth=1e9,
        collective_bandwidth=1e9,
        measured_at=0.0,
        fsdp_unit_overhead=0.0004,
        tensor_module_overhead=0.0025,
        accumulate_seconds_per_byte=0.000125 / 2**20,
        pack_seconds_per_byte=0.00075 / 2**20,
    )
    assert "FSDP 0.400 ms per unit" in cal.describe()
    assert "tensor parallelism 2.500 ms per module" in cal.describe()
    assert "gradient accumulation 0.125 ms per MiB" in cal.describe()
    assert "packing for the gradient sum 0.750 ms per MiB" in cal.describe()
