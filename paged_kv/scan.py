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

import contextlib

import jax
import jax.numpy as jnp
from jax import lax

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


def while_needed(cond_fun, body_fun, init):
    """``lax.while_loop(cond_fun, body_fun, init)``, entered only when ``cond_fun(init)`` holds.

    For loops that usually run zero iterations (probing past a window, skipping stale queue
    entries): on XLA:CPU a ``while`` costs a few microseconds per call even when it does not
    iterate, a ``cond`` that skips it well under one.
    """
    return lax.cond(cond_fun(init), lambda c: lax.while_loop(cond_fun, body_fun, c), lambda c: c, init)


def straight_or_repair(slow, state, straight, general):
    """For a GPU: ``general(state)`` if ``slow`` (bool scalar) else ``straight(state, True)``,
    with the straight-line form run unconditionally and the rare one in a loop of at most one
    trip: on the common path one host sync (the loop's condition), as a ``cond`` would cost.

    Why not ``lax.cond(slow, general, straight)``: a ``cond`` whose branches update pool-sized
    arrays in place made XLA:GPU copy them on every call (``append``: the token array, the
    hash-table entries and the queue's ``[num_blocks]`` slots, ~2.5 MiB per call at 16k blocks,
    ~16 MiB at 100k), and so did a ``cond`` with a pass-through branch (it copied its outputs into
    the donated buffers). A ``while`` carries its state in place, so the common path's
    pool-sized scatters, outside it, copy nothing; any copy the rare form needs stays in the
    loop body.

    Args:
      straight: ``(state, keep) -> (state, outputs)``; with ``keep`` (bool scalar) False it
        must return ``state`` unchanged, bit for bit (every write masked off: the index arrays
        are batch-sized, so the mask costs nothing); its outputs are then discarded.
      general: ``state -> (state, outputs)``, the same structure; it is given the unchanged
        state.
    """
    out = straight(state, ~slow)
    _, out = lax.while_loop(lambda c: c[0], lambda c: (jnp.zeros_like(c[0]), general(c[1][0])), (slow, out))
    return out


_STRAIGHT_LINE_ON_CPU = False
_FORMS_FOR: str | None = None  # set by ``forms_for`` while a program of known platform is traced


def per_platform(*operands, cpu, default):
    """``lax.platform_dependent(*operands, cpu=cpu, default=default)``: the form tuned for
    XLA:CPU (skips and loops that only run when needed) on a CPU, the straight-line form for a GPU
    elsewhere, chosen when the program is lowered. On XLA:GPU every ``cond`` predicate and
    ``while`` condition is read back on the host (a device-to-host sync; XLA 0.10.2 puts none of
    them into CUDA graphs), while a masked kernel costs nothing next to it.

    ``lax.platform_dependent`` traces both forms (it lowers only one). Inside ``forms_for(p)``
    only the form for platform ``p`` is traced, which is what a program that knows where it runs
    uses (the serving engine's step: it saves a warm start a fifth of its tracing). Under
    ``straight_line_on_cpu()`` (tests) the ``default`` form is traced on every platform."""
    if _STRAIGHT_LINE_ON_CPU:
        return default(*operands)
    if _FORMS_FOR is not None:
        return (cpu if _FORMS_FOR == "cpu" else default)(*operands)
    return lax.platform_dependent(*operands, cpu=cpu, default=default)


@contextlib.contextmanager
def forms_for(platform: str | None):
    """Trace only ``platform``'s form of every ``per_platform`` in the block (None: both, as
    ``lax.platform_dependent``). Use it inside a jitted function whose jit key holds
    ``platform`` (a static argument), so that a trace for one platform is never reused for
    another; ``program_platform`` gives the platform to pass."""
    global _FORMS_FOR
    old, _FORMS_FOR = _FORMS_FOR, platform
    try:
        yield
    finally:
        _FORMS_FOR = old


def program_platform(*arrays) -> str | None:
    """The platform a program on ``arrays`` (``jax.Array`` s) is lowered for, when this process
    can only lower it there: every device of the arrays has the default backend's platform.
    Otherwise None (e.g. a GPU target compiled from a CPU process, as the GPU compile gate does):
    then ``per_platform`` keeps both forms and the lowering chooses."""
    platforms = {d.platform for a in arrays for d in a.devices()}
    if len(platforms) == 1 and platforms == {jax.default_backend()}:
        return platforms.pop()
    return None


@contextlib.contextmanager
def straight_line_on_cpu():
    """Trace the GPU forms of ``per_platform`` on a CPU too, so that tests can compare them with
    the CPU forms (bit for bit). Read at trace time: jit a fresh function inside the block."""
    global _STRAIGHT_LINE_ON_CPU
    old, _STRAIGHT_LINE_ON_CPU = _STRAIGHT_LINE_ON_CPU, True
    try:
        yield
    finally:
        _STRAIGHT_LINE_ON_CPU = old
