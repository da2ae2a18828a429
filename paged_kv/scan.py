"""Prefix sums, leading runs and ``any`` over small batch axes, and a rarely-looping ``while``, in
the forms that XLA:CPU runs fastest.

Why these forms: a one-request admission is ~100 small kernels, each costing a fixed fraction of a
microsecond, so the number of kernels decides its cost. XLA:CPU rewrites every single-output
reduction over an axis longer than 32 into two kernels (a reduce-window of 32-element partials,
then a reduce) and ``jnp.cumsum`` into a tree of them; a two-output reduction such as ``argmax``
it leaves whole, as one kernel that also absorbs the elementwise work producing its input. Such a
kernel also has a tuple-shaped result, which XLA:CPU never splits across threads, while it splits
every other kernel that reads or writes a pool-sized array (see ``scripts/bench_prefix_cache.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax import lax

T = TypeVar("T")
StateT = TypeVar("StateT")
OutT = TypeVar("OutT")

TRIANGLE_MAX = 256
"""Up to this many elements on the summed axis, ``prefix_sum`` is one masked reduction over a
``[K, K]`` triangle, which fuses with whatever computes ``x``. XLA:CPU splits ``jnp.cumsum`` into
a tree of reduce-windows, about five kernels for 36 elements: on a one-request admission the
cumsums were a fifth of all kernels run."""


def prefix_sum(x: jax.Array) -> jax.Array:
    """int32 ``[..., K]`` inclusive prefix sums of ``x`` (bool or int) along its last axis."""
    x = x.astype(jnp.int32)
    k = x.shape[-1]
    if k > TRIANGLE_MAX:
        return jnp.cumsum(x, axis=-1, dtype=jnp.int32)
    lanes = jnp.arange(k, dtype=jnp.int32)
    upto = lanes[None, :] <= lanes[:, None]  # [K (output), K (input)]
    return jnp.sum(jnp.where(upto, x[..., None, :], 0), axis=-1, dtype=jnp.int32)


def leading_count(mask: jax.Array) -> jax.Array:
    """int32 ``[...]``: the length of the all-True run at the start of ``mask`` (bool
    ``[..., K]``) along its last axis: the position of the first False, found by one ``argmin``
    over ``mask`` with a False appended (so an all-True row gives ``K``)."""
    pad = [(0, 0)] * (mask.ndim - 1) + [(0, 1)]
    return jnp.argmin(jnp.pad(mask, pad), axis=-1).astype(jnp.int32)


def any_true(mask: jax.Array) -> jax.Array:
    """bool scalar: ``jnp.any(mask)`` as one ``argmax`` kernel (see the module note): the first
    True of ``mask`` with a True appended lies before the end iff ``mask`` has one."""
    flat = mask.reshape(-1)
    return jnp.argmax(jnp.pad(flat, (0, 1), constant_values=True)) < flat.shape[0]


def while_needed(cond_fun: Callable[[T], jax.Array], body_fun: Callable[[T], T], init: T) -> T:
    """``lax.while_loop(cond_fun, body_fun, init)``, entered only when ``cond_fun(init)`` holds.

    For loops that usually run zero iterations (probing past a window, skipping stale queue
    entries): on XLA:CPU a ``while`` costs a few microseconds per call even when it does not
    iterate, a ``cond`` that skips it well under one.
    """
    return lax.cond(cond_fun(init), lambda c: lax.while_loop(cond_fun, body_fun, c), lambda c: c, init)


def repair(slow: jax.Array, out: tuple[StateT, OutT],
           general: Callable[[StateT], tuple[StateT, OutT]]) -> tuple[StateT, OutT]:
    """For a GPU: ``out`` (``(state, outputs)``, what the straight-line form of an operation
    returned) unless ``slow`` (bool scalar), else ``general(state)``, the operation redone in a
    loop of at most one trip: on the common path one host sync (the loop's condition), as a
    ``cond`` would cost.

    The straight-line form must have run with every write masked off when ``slow`` holds (the
    index arrays are batch-sized, so the mask costs nothing): its ``state`` is then the input bit
    for bit, and ``general`` (``state -> (state, outputs)``, the same structure) starts from it.

    Why not ``lax.cond(slow, general, straight)``: a ``cond`` whose branches update pool-sized
    arrays in place made XLA:GPU copy them on every call (``append``: the token array, the
    hash-table entries and the queue's ``[num_blocks]`` slots), and so did a ``cond`` with a
    pass-through branch (it copied its outputs into the donated buffers). A ``while`` carries its
    state in place, so the common path's pool-sized scatters, outside it, copy nothing; any copy
    the rare form needs stays in the loop body.
    """
    _, out = lax.while_loop(lambda c: c[0], lambda c: (jnp.zeros_like(c[0]), general(c[1][0])), (slow, out))
    return out


def per_platform(target: str, *operands: Any, cpu: Callable[..., T], default: Callable[..., T]) -> T:
    """The form of an operation for ``target`` (``ManagerConfig.target``): ``cpu(*operands)``,
    tuned for XLA:CPU (skips and loops that only run when needed), for ``"cpu"``;
    ``default(*operands)``, the straight-line form for a GPU, for ``"gpu"``; for ``"auto"``
    ``lax.platform_dependent``, which traces both and lowers the CPU form on a CPU, the other
    elsewhere. On XLA:GPU every ``cond`` predicate and ``while`` condition is read back on the
    host (a device-to-host sync; XLA puts none of them into CUDA graphs), while a masked kernel
    costs nothing next to it. Both forms give the same results bit for bit."""
    if target == "cpu":
        return cpu(*operands)
    if target == "gpu":
        return default(*operands)
    return lax.platform_dependent(*operands, cpu=cpu, default=default)


def target_of(*arrays: jax.Array) -> str:
    """The ``ManagerConfig.target`` for a program on ``arrays`` (``jax.Array`` s): ``"cpu"`` or
    ``"gpu"`` when this process can only lower it for their platform (every device of the arrays
    has the default backend's platform), so that only that form is traced (a fifth of a warm
    start's tracing, for the serving engine's step). Otherwise ``"auto"`` (e.g. a GPU program
    compiled from a CPU process, as the GPU compile gate does): the lowering chooses."""
    platforms = {d.platform for a in arrays for d in a.devices()}
    if len(platforms) == 1 and platforms == {jax.default_backend()}:
        return "cpu" if platforms == {"cpu"} else "gpu"
    return "auto"
