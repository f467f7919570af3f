"""Parameters sharded over a process mesh (``DTensor``), read and written one rank's part at a time.

[Note: sharded tensors]
A dialect that shards a stage over a data axis (FSDP2's ``fully_shard``) or a tensor axis
(``parallelize_module``) replaces each parameter with a ``DTensor``: a global shape, a device
mesh, a placement per mesh dimension (``Shard(dim)`` or ``Replicate()``) and this rank's local
part. Everything in pipedialect that touches parameters outside the forward and backward --
tied-weight sums, gradient norms, finiteness checks, loading weights, checkpoints -- works on
the local part, never through a ``DTensor`` operation, because those are collectives and a
collective that only some ranks reach hangs. These helpers are written once here:

- :func:`local_part`: the rank's own tensor (the tensor itself when it is not sharded);
- :func:`counted_square_norm`: the squared 2-norm of the elements this rank *counts*, so that
  summing it over every rank of the mesh counts each element of the global tensor once: a
  part replicated over a mesh dimension is counted on coordinate 0 of that dimension only;
- :func:`copy_full_into`: fill a parameter (sharded or not) from the whole tensor, writing only
  this rank's slice (weights loaded by name, checkpoints read whole);
- :func:`shard_like`: the whole tensor cut to another tensor's sharding (optimizer state read
  whole, for a sharded parameter);
- :func:`gathered`: the whole tensor, gathered from every rank of its mesh (a collective: for
  tests and reports that compare whole tensors).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "copy_full_into",
    "counted_square_norm",
    "gathered",
    "is_sharded",
    "local_part",
    "local_slice",
    "shard_like",
]


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a parameter or gradient laid out over a mesh)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: its local tensor if sharded (the same storage, so an
    in-place operation on it changes ``tensor``), else ``tensor`` itself."""
    if is_sharded(tensor):
        with torch.no_grad():
            local: torch.Tensor = tensor.to_local()  # type: ignore[attr-defined]
        return local
    return tensor


def _counts_here(tensor: torch.Tensor) -> bool:
    """Whether this rank counts its local part of ``tensor`` in a sum over the whole mesh."""
    from torch.distributed.tensor import Replicate

    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    coords = mesh.get_coordinate()
    if coords is None:  # not on the mesh at all
        return False
    return all(
        coord == 0
        for coord, placement in zip(coords, tensor.placements, strict=True)  # type: ignore[attr-defined]
        if isinstance(placement, Replicate)
    )


def counted_square_norm(tensor: torch.Tensor) -> torch.Tensor:
    """The squared fp32 2-norm of the elements of ``tensor`` this rank counts (see the module
    note); for a tensor that is not sharded, its whole squared norm. No collective."""
    if is_sharded(tensor):
        if not _counts_here(tensor):
            return torch.zeros((), device=local_part(tensor).device)
        tensor = local_part(tensor)
    square: torch.Tensor = tensor.detach().float().norm(2).pow(2)
    return square


def local_slice(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The slice of the whole tensor ``full`` that this rank holds of ``like`` (``full``
    itself when ``like`` is not sharded). ``full`` must have ``like``'s global shape."""
    if not is_sharded(like):
        return full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        like.shape,
        like.device_mesh,  # type: ignore[attr-defined]
        like.placements,  # type: ignore[attr-defined]
    )
    out = full
    for dim, (start, length) in enumerate(zip(offset, shape, strict=True)):
        if length != full.shape[dim]:
            out = out.narrow(dim, start, length)
    return out


def copy_full_into(dest: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the whole tensor ``full`` into ``dest``; a sharded ``dest`` takes only its slice."""
    with torch.no_grad():
        local_part(dest).copy_(local_slice(full, dest))


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as ``like`` is: a ``DTensor`` holding this rank's slice when ``like``
    is sharded, else ``full`` itself."""
    if not is_sharded(like):
        return full
    from torch.distributed.tensor import DTensor

    local = local_slice(full, like).to(local_part(like).device).clone()
    return DTensor.from_local(
        local,
        like.device_mesh,  # type: ignore[attr-defined]
        like.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of ``tensor``: gathered from its mesh when sharded (a collective every rank of
    that mesh must call alike), else ``tensor`` itself."""
    if is_sharded(tensor):
        with torch.no_grad():
            whole: torch.Tensor = tensor.full_tensor()  # type: ignore[attr-defined]
        return whole
    return tensor
