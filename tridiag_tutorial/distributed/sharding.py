r"""Sharding rules for the ops, so that the public functions accept ``DTensor`` inputs.

Under tensor parallelism a user's inputs are :class:`torch.distributed.tensor.DTensor`\ s: each
rank holds a piece (a *shard*) of a global tensor, and every placement says how a tensor is laid
out over one dimension of the device mesh (``Replicate()``: every rank has all of it;
``Shard(d)``: dimension ``d`` is split across the ranks). When an op meets DTensors, DTensor asks
its *sharding propagator* which input placements the op can run on and what placements its
output then has; for an op it knows nothing about, the call fails before any kernel runs (the
first line of the error on torch 2.13, one line, wrapped here)::

    NotImplementedError: Operator tridiag_tutorial.solve_kernel.default does not have a
    sharding strategy registered.

This module gives it that knowledge with
:func:`torch.distributed.tensor.experimental.register_sharding` (an experimental torch API: a
rule function that lists, for one mesh dimension, the acceptable ``(output placements, input
placements)`` pairs; torch expands them to every dimension of the mesh, keeps the pairs whose
shards are not empty, and redistributes the inputs to the cheapest one). A system is solved where
all of its data is: the solve couples every row of a system to every other, but nothing couples
two systems of a batch, nor two columns of a right-hand side. So the rules are

- **everything replicated**: the output is replicated (every rank solves everything);
- **a batch dimension** ``d`` (one of the leading ``*B``) **sharded on every tensor input**: the
  output is sharded on ``d``; each rank solves its own systems;
- **the columns of** ``rhs`` (its last dimension, ``k`` of ``(*B, n, k)``) **sharded, the bands
  and factors replicated**: the output is sharded on its last dimension; each rank solves its
  columns with the whole matrix.

What is not listed (the system dimension ``n`` sharded, mixed placements, ``Partial`` inputs) is
redistributed by DTensor to the cheapest listed pair: always correct, though it may all-gather.
A system whose rows stay spread over the ranks needs a distributed algorithm instead, the
partitioned method with one block per rank: :func:`tridiag_tutorial.distributed.solve.split_solve`,
on each rank's local rows (not DTensors).

Which ops need rules: a DTensor input is not a plain tensor, so the public functions take their
general path (:func:`tridiag_tutorial.functions._direct` is false) and reach the ops through the
dispatcher: ``tridiag_tutorial::solve_kernel`` forward and backward (the eager
``autograd.Function`` calls it, and so does a function compiled with ``torch.compile``) and
``tridiag_tutorial::lu_factor`` for the factors. The op ``tridiag_tutorial::solve`` has an
Autograd kernel of its own, which runs before DTensor sees the call and calls ``solve_kernel``;
called directly under ``torch.inference_mode()``, which skips Autograd kernels, it reaches
DTensor itself, so it gets the same rules. The Autograd machinery and the derivative rules
(:mod:`tridiag_tutorial.rules`) run on the DTensors with ordinary torch ops, which DTensor
already knows, so gradients come back as DTensors too, though not always with their input's
placements: the gradient of a replicated band may come back ``Shard(d)`` or ``Partial()`` (the
sum over ranks is the gradient), the same global tensor laid out lazily; ``full_tensor()`` or
``redistribute()`` gives it any layout.

Importing this module registers the rules (``import tridiag_tutorial.distributed.sharding``); it calls
:func:`register`, which does nothing when called again. ``import tridiag_tutorial`` does not
import this module, so the package does not load ``torch.distributed.tensor`` for users who never
distribute a tensor; the public functions import it the first time a DTensor reaches them
(:func:`tridiag_tutorial.functions._register_sharding_for`). A function of DTensors compiled with
``torch.compile``, and a direct call of the ops, need ``import tridiag_tutorial.distributed.sharding``
first.

Not covered: a singular system raises :class:`~tridiag_tutorial.SingularMatrixError` on the ranks
that hold it only (the others go on, and their next collective waits until it times out), with a
``batch_index`` counted within that rank's shard.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from .. import _schemas  # noqa: F401  (the ops' schemas, where the extension was not built)

__all__ = ["register", "solve_strategies", "lu_factor_strategies", "OPS"]

#: The ops that get rules, by their names in ``torch.ops.tridiag_tutorial``.
OPS = ("solve_kernel", "solve", "lu_factor")

_registered = False


def solve_strategies(lower, diag, upper, rhs, lu, pivots, trans, driver):
    """The acceptable placements of ``solve_kernel`` / ``solve`` on one mesh dimension.

    The arguments are those of the op (``lower``, ``diag``, ``upper`` ``(*B, n-1)``, ``(*B, n)``,
    ``(*B, n-1)``, ``rhs`` ``(*B, n, k)``, the optional factors ``lu`` ``(*B, 4, n)`` and
    ``pivots`` ``(*B, n)``, ``trans``, ``driver``), with each tensor replaced by DTensor's
    description of it (a ``DTensorSpec``: its global shape and placements), ``None`` where a
    factor is absent.

    Returns a list of ``(output placements, input placements)``: one output placement (the
    solution ``x``, ``(*B, n, k)``) and one entry per argument, in the op's order: a placement
    for each tensor, ``None`` for absent factors and for the two strings. The pairs:

    - ``x`` ``Replicate()`` from every tensor replicated;
    - ``x`` ``Shard(d)`` from every tensor ``Shard(d)``, for each batch dimension ``d <
      len(B)``: the same index in every input, since all have the batch dimensions first;
    - ``x`` ``Shard(len(B) + 1)`` (its columns) from ``rhs`` ``Shard(len(B) + 1)`` and the bands
      and factors replicated.

    Only the number of dimensions is read: the rules do not depend on the values of ``trans``
    and ``driver``, nor on the sizes (torch drops a pair whose sharded dimension has fewer
    entries than the mesh dimension has ranks).
    """
    batch_dims = diag.ndim - 1
    factored = lu is not None

    def inputs(bands, right):  # the factors, where given, are laid out as the bands
        factors = bands if factored else None
        return [bands, bands, bands, right, factors, factors, None, None]

    replicate = Replicate()
    strategies = [([replicate], inputs(replicate, replicate))]
    for d in range(batch_dims):
        strategies.append(([Shard(d)], inputs(Shard(d), Shard(d))))
    columns = Shard(rhs.ndim - 1)
    strategies.append(([columns], inputs(replicate, columns)))
    return strategies


def lu_factor_strategies(lower, diag, upper, driver):
    """The acceptable placements of ``lu_factor`` on one mesh dimension.

    The arguments are the op's (the bands ``(*B, n-1)``, ``(*B, n)``, ``(*B, n-1)`` as DTensor
    describes them, and ``driver``). Returns ``(output placements, input placements)`` pairs with
    two outputs, ``lu`` ``(*B, 4, n)`` and ``pivots`` ``(*B, n)``, and one input entry per argument
    (``None`` for ``driver``):

    - both outputs ``Replicate()`` from the bands replicated;
    - both outputs ``Shard(d)`` from the bands ``Shard(d)``, for each batch dimension ``d``: each
      rank factors its own matrices.
    """
    replicate = Replicate()
    strategies = [([replicate, replicate], [replicate, replicate, replicate, None])]
    for d in range(diag.ndim - 1):
        strategies.append(([Shard(d), Shard(d)], [Shard(d), Shard(d), Shard(d), None]))
    return strategies


# [book: sharding-register]
def register() -> None:
    """Register the rules with DTensor's sharding propagator (once per process: later calls do
    nothing). Importing this module calls it."""
    global _registered
    if _registered:
        return
    ops = torch.ops.tridiag_tutorial
    register_sharding([ops.solve_kernel.default, ops.solve.default])(solve_strategies)
    register_sharding(ops.lu_factor.default)(lu_factor_strategies)
    _registered = True


register()
