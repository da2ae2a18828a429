"""The serving step's packed form (what ``DeviceStep`` sends and reads back): packing changes no
bit of any input or output, the sampler's lazily derived keys draw what eager keys draw, the
interned static argument is shared by equal values, and the skipped top candidates are only
those of steps without a beam row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_kv as pk
from paged_kv.engine import step_io as ss
from paged_kv.engine.sampling import sample_rows
from paged_kv.engine.serving_types import ServingConfig

MGR = pk.ManagerConfig(num_blocks=33, block_size=8, max_seqs=6, max_blocks_per_seq=4)


def _inputs(rng, r=6, p=3, c=5) -> ss.StepInputs:
    ints = lambda *shape: rng.integers(-1, 1000, shape).astype(np.int32)
    odd = np.array([0.0, -0.0, np.nan, np.inf, 1e-45, 0.7], np.float32)  # bits a cast would lose
    return ss.StepInputs(
        free_ids=ints(r), sel_dst=ints(r), sel_parent=ints(r), pf_rows=ints(p), pf_tokens=ints(p, c),
        pf_start=ints(p), pf_lens=ints(p), dec_tokens=ints(r), dec_live=rng.random(r) < 0.5, fork_src=ints(r),
        fork_dst=ints(r), logit_src=ints(r), temperature=rng.permutation(odd), top_k=ints(r),
        top_p=rng.random(r).astype(np.float32), seed=ints(r), sample_idx=ints(r), token_idx=ints(r),
        beam=rng.random(r) < 0.5, left=ints(r), n_steps=ints(r), eos=ints(ss.EOS_SLOTS, r),
        stop_on_finish=rng.random(r) < 0.5)


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.int32) if x.dtype == np.float32 else x


def test_inputs_round_trip_bit_for_bit():
    inp = _inputs(np.random.default_rng(0))
    back = jax.jit(ss.unpack_inputs)(*ss.pack_inputs(inp))
    for f in inp.__dataclass_fields__:
        a, b = np.asarray(getattr(inp, f)), np.asarray(getattr(back, f))
        assert a.dtype == b.dtype and a.shape == b.shape, f
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f)


def test_a_new_field_round_trips_from_its_one_declaration():
    """Packing is declared once (``ROW_LAYOUT``: field, dtype, rows): a layout with a new float,
    bool and multi-row field packs and unpacks bit for bit with no other change, and every
    ``StepInputs`` field is declared (else importing step_io fails)."""
    rng = np.random.default_rng(2)
    layout = ss.ROW_LAYOUT + (("min_p", np.float32, 1), ("greedy", np.bool_, 1), ("stop_ids", np.int32, 3))
    inp = _inputs(rng)
    values = {f: getattr(inp, f) for f, _, _ in ss.ROW_LAYOUT}
    values.update(min_p=np.array([0.0, -0.0, np.nan, 1e-45, 0.5, np.inf], np.float32),
                  greedy=rng.random(6) < 0.5, stop_ids=rng.integers(-1, 99, (3, 6)).astype(np.int32))
    back = jax.jit(lambda rows: ss.unpack_rows(rows, layout))(ss.pack_rows(values, layout))
    assert set(back) == set(values)
    for f, v in values.items():
        a, b = np.asarray(v), np.asarray(back[f])
        assert a.dtype == b.dtype and a.shape == b.shape, f
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f)
    declared = {f for f, _, _ in ss.ROW_LAYOUT} | set(ss.PREFILL_FIELDS)
    assert declared == set(ss.StepInputs.__dataclass_fields__)


@pytest.mark.parametrize("record_tables", [True, False])
def test_outputs_round_trip_bit_for_bit(record_tables):
    cfg = ServingConfig(MGR, chunk_size=8, max_prefill_rows=2, top_candidates=3, record_tables=record_tables)
    rng = np.random.default_rng(1)
    fields = {}
    for name, shape, dtype in ss.output_layout(cfg):
        x = rng.standard_normal(shape).astype(dtype) if dtype == np.float32 else rng.integers(-9, 99, shape)
        fields[name] = np.asarray(x, dtype)
    fields["logprobs"][:2] = [np.nan, -0.0]
    out = ss.StepOutputs(**fields)
    back = ss.unpack_outputs(cfg, np.asarray(jax.jit(lambda o: ss.pack_outputs(cfg, o))(out)))
    for name in fields:
        a, b = fields[name], getattr(back, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=name)


def test_lazy_keys_draw_what_eager_keys_draw():
    r, v = 5, 41
    x = jnp.asarray(np.random.default_rng(2).standard_normal((r, v)).astype(np.float32) * 2)
    keys = lambda: jax.vmap(lambda i: jax.random.fold_in(jax.random.key(3), i))(jnp.arange(r))
    temp = jnp.array([0.0, 0.8, 1.3, 0.0, 0.5])
    top_k, top_p = jnp.array([0, 3, 0, 0, 7], jnp.int32), jnp.array([1.0, 1.0, 0.6, 1.0, 0.9])
    for t in (temp, jnp.zeros(r)):  # some rows drawing, and a greedy step (the draw skipped)
        eager = jax.jit(lambda x, t: sample_rows(x, keys(), t, top_k, top_p))(x, t)
        lazy = jax.jit(lambda x, t: sample_rows(x, keys, t, top_k, top_p))(x, t)
        for a, b in zip(eager, lazy):
            np.testing.assert_array_equal(_bits(a), _bits(b))


def test_intern_shares_one_holder_per_value():
    a, b = ss.intern(("graph", (1, 2))), ss.intern(("graph", (1, 2)))
    assert a is b and hash(a) == hash(("graph", (1, 2)))
    assert ss.intern(("graph", (1, 3))) is not a
    assert ss.Interned(("graph", (1, 2))) == a  # a fresh holder still compares by value


def test_engines_over_one_model_share_the_compiled_step():
    from paged_kv.engine.serving import ServingEngine
    from paged_kv.models import load_hf_checkpoint

    model = load_hf_checkpoint("checkpoints/tiny-llama")
    cfg = ServingConfig(MGR, chunk_size=8, max_prefill_rows=2)
    a, b = ServingEngine(model, cfg), ServingEngine(model, cfg)
    assert a.device._model is b.device._model
