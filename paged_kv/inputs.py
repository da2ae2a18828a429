"""Input checks shared by the core and the engine: host-side scalar checks (``is_int``,
``is_real``) and trace-time checks of the functional operations' array arguments.

Shapes and dtypes are static under ``jit``, so a float id, a mis-shaped length array or an
unsigned id that would wrap to padding is refused with a ``ValueError`` before anything is traced,
instead of being truncated (4.7 -> 4) or broadcast ([1] against [2]). Values are not static: an
id out of range or a bad length is a per-row ``Status`` at run time (see ``batch.check_rows``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


# ``pallas_kernels.validate.is_int`` is the same check for the kernels and models: the kernels
# import nothing from the rest of the repository and the core imports neither kernels nor
# models, so each side keeps one definition (tests/test_module_layout.py checks they agree).
def is_int(v: Any) -> bool:
    """A Python or NumPy integer scalar; bools (Python or NumPy) are not ints here, so ``True``
    is refused where an id, a count or a seed is expected."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def is_real(v: Any) -> bool:
    """A Python or NumPy int or float scalar (not a bool). NaN and inf pass: callers that need a
    finite value check ``math.isfinite`` too."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def _array(op: str, name: str, x: Any) -> np.ndarray | jax.Array:
    if x is None:
        raise ValueError(f"{op}: {name} is None; expected an int32 array")
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        try:
            x = np.asarray(x)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{op}: {name} is not an array of integers ({type(x).__name__}): {e}") from None
    return x


def int_array(op: str, name: str, x: Any, *, ndim: int, batch: int | None = None,
              unsigned_ok: bool = False) -> np.ndarray | jax.Array:
    """``x`` as given (or as a NumPy array, for a list), after checking that it has ``ndim``
    dimensions, ``batch`` rows if given, and an integer dtype: signed (ids, lengths, tokens; an
    unsigned id of 2**32 - 1 would wrap to -1, padding) or, with ``unsigned_ok``, any integer
    dtype (salts). Bools and floats are refused."""
    x = _array(op, name, x)
    dtype = np.dtype(x.dtype)
    signed = jnp.issubdtype(dtype, jnp.signedinteger)
    if dtype == np.bool_ or not (signed or (unsigned_ok and jnp.issubdtype(dtype, jnp.unsignedinteger))):
        want = "an integer" if unsigned_ok else "a signed integer (int32)"
        raise ValueError(f"{op}: {name} must have {want} dtype, got {dtype}")
    if len(x.shape) != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dimension(s), got shape {tuple(x.shape)}")
    if dtype.itemsize > 4 and isinstance(x, np.ndarray) and x.size:
        # A concrete 64-bit array: JAX would cast it to int32 at the jit boundary, wrapping
        # values (2**32 -> 0, a valid id); check the values while they are still on the host.
        lo, hi = (0, 2**32 - 1) if not signed else (-(2**31), 2**31 - 1)
        if x.min() < lo or x.max() > hi:
            raise ValueError(f"{op}: {name} holds {x.max() if x.max() > hi else x.min()}, outside the "
                             f"{'uint32' if not signed else 'int32'} range [{lo}, {hi}]")
    if batch is not None and x.shape[0] != batch:
        raise ValueError(
            f"{op}: {name} has {x.shape[0]} rows but the batch (seq_ids) has {batch}; shapes must match "
            f"exactly (no broadcasting)"
        )
    return x


def batch_ids(op: str, name: str, x: Any) -> tuple[np.ndarray | jax.Array, int]:
    """A batch of sequence ids: int32 ``[B]``; returns it and ``B``."""
    x = int_array(op, name, x, ndim=1)
    return x, x.shape[0]
