"""Suite-wide fixtures."""

import gc

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module.

    XLA:CPU maps a few memory regions per compiled executable and keeps them while JAX's caches
    hold the executable. The whole suite compiles thousands of programs: kept, they passed the
    kernel's limit of 65,530 mappings per process (``vm.max_map_count``) about three quarters of
    the way through, and the next compilation crashed the process (a segfault inside XLA). No test
    relies on a program compiled by another module.
    """
    yield
    jax.clear_caches()
    gc.collect()
