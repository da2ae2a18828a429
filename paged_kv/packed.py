"""Scalars of a state struct packed into one small int32 vector, read by name."""

from __future__ import annotations

from typing import TypeVar

import jax.numpy as jnp

T = TypeVar("T")


def with_packed_scalars(cls: type[T], packed: str, names: tuple[str, ...]) -> type[T]:
    """Gives ``cls`` read-only properties ``names`` for the entries of its int32 vector field
    ``packed``, and a ``replace`` that accepts them as keywords.

    Scalars live in one small array instead of a leaf each: every leaf of the state costs a few
    microseconds of argument handling on each jitted call that takes the state (26 leaves were
    about a third of a one-request admission on XLA:CPU)."""
    index = {name: i for i, name in enumerate(names)}
    for name, i in index.items():
        setattr(cls, name, property(lambda self, i=i: getattr(self, packed)[i],
                                    doc=f"int32 scalar, entry {i} of ``{packed}``."))
    base_replace = cls.replace

    def replace(self, **changes):
        scalars = {k: changes.pop(k) for k in names if k in changes}
        if scalars:
            vec = getattr(self, packed)
            if len(scalars) == len(names):
                vec = jnp.stack([jnp.asarray(scalars[k], jnp.int32) for k in names])
            else:
                for k, v in scalars.items():
                    vec = vec.at[index[k]].set(jnp.asarray(v, jnp.int32))
            changes[packed] = vec
        return base_replace(self, **changes)

    cls.replace = replace
    return cls
