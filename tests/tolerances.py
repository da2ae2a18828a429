"""Tolerances of the parity tests, derived from floating-point error analysis.

Every parity test compares two computations of one function that differ only in rounding: the
summation order or blocking (paged vs contiguous attention, a Pallas kernel vs its XLA
reference, chunked vs whole prefill, sharded vs single-device matmuls, our Llama vs
transformers'), or one computation against an exact float64 one. The tolerance therefore
follows from the standard model of floating-point arithmetic (Higham, *Accuracy and Stability
of Numerical Algorithms*, 2nd ed., SIAM 2002, sections 2.2 and 3.1), not from the rounding one
machine happened to produce:

* Each operation is exact up to a relative error of at most the unit roundoff ``u = eps / 2``
  (float32 ``eps = 2**-23``, bfloat16 ``eps = 2**-7``).
* A sum or dot product of length ``K``, in ANY order or blocking, satisfies (Higham (3.5))::

      |fl(sum_i a_i b_i) - sum_i a_i b_i| <= gamma_K * sum_i |a_i b_i|,
      gamma_K = K u / (1 - K u) ~= K u.

  Two evaluations that differ only in order are each within that bound of the exact value, so
  they differ by at most ``2 K u sum|a_i b_i| = K eps sum|a_i b_i|`` (:func:`chain_atol` with
  one stage). A comparison against an exact reference then has a factor 2 to spare.
* A chain of stages (a layer stack) composes to first order: the relative errors of the stages
  add, each relative to the magnitude of the stage's result. In a pre-norm transformer every
  stage's input is renormalised (RMSNorm) or is a convex combination (softmax weights times V),
  so no stage amplifies the relative error of its input by more than a factor of order one, and
  the logits of two computations differ by at most::

      |x - y| <= (eps_acc * sum_i K_i  +  eps_store * R / 2) * M                   (chain_atol)

  with ``K_i`` the reduction length of stage ``i`` (accumulated in ``eps_acc``'s dtype, float32
  here), ``R`` the number of roundings to a narrower storage dtype (bfloat16) along the chain,
  counted over BOTH computations (each costs ``u_store = eps_store / 2``), and ``M`` the
  magnitude of the result (the logits' ``max |.|``). :func:`llama_reduction_lens` lists the
  ``K_i`` of the Llama here: RMSNorm over ``hidden``, the projections over ``hidden``, the
  attention (below), ``o_proj`` over ``heads * head_dim``, ``down`` over ``intermediate``, the LM
  head over ``hidden``, plus the elementwise roundings.
* Attention is the one stage that can amplify: a score's absolute error is a relative error of
  its softmax weight, and scores have magnitude up to ``S = scale * max sum_i |q_i k_i|``, so a
  length-``D`` score dot counts as ``2 (D + 4) S`` summands, next to ``4 n + 7`` for the softmax
  and ``P V`` over ``n`` keys (:func:`attention_atol`). ``S`` is measured from the data in the
  kernel tests (:func:`score_magnitude`) and bounded from the weights for a model
  (:func:`score_bound`; :func:`logits_bound` bounds the logits the same way).

These are worst-case bounds: the typical rounding error of a sum grows like ``sqrt(K) u``
rather than ``K u`` (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019), so observed float32
errors sit two to four orders of magnitude below them on any machine (a single bfloat16
rounding of an output is nearly attained), while a wrong result (a dropped or shifted token,
an off-by-one position, a softmax scale off by 0.1-1 %) misses them. float32 matmuls are assumed
to run in float32 (XLA on a CPU; a GPU using TF32 would need ``eps = 2**-10``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import jax.numpy as jnp
import numpy as np


def eps(dtype) -> float:
  """Machine epsilon of ``dtype`` (the gap between 1 and the next number; ``u = eps / 2``)."""
  return float(jnp.finfo(dtype).eps)


def chain_atol(dtype, reduction_lens: Iterable[float], magnitude: float, *, roundings: float = 0,
               accum_dtype=jnp.float32) -> float:
  """First-order bound on ``|x - y|`` between two computations of a chain (module docstring).

  Args:
    dtype: storage dtype of the chain's intermediate values.
    reduction_lens: reduction length ``K_i`` (summands, elementwise roundings count 1) of every
      stage along the chain, accumulated in ``accum_dtype``.
    magnitude: ``M``, the magnitude of the result (``max |.|`` of the compared values, or a bound
      of ``sum |a_i b_i|`` for a single dot product).
    roundings: roundings to ``dtype`` along the chain, over both computations together; ignored
      when ``dtype`` is as precise as ``accum_dtype`` (then they are part of ``gamma_K``).
  """
  acc, store = eps(accum_dtype), eps(dtype)
  narrow = roundings * store / 2 if store > acc else 0.0
  return (acc * float(sum(reduction_lens)) + narrow) * float(magnitude)


def score_magnitude(q, k, scale: float) -> float:
  """``S = scale * max over (query, key) of sum_i |q_i k_i|``, over every query row of ``q
  [..., D]`` and every key row of ``k [..., D]`` (an upper bound for any visible subset)."""
  q = np.abs(np.asarray(q, np.float64)).reshape(-1, np.shape(q)[-1])
  k = np.abs(np.asarray(k, np.float64)).reshape(-1, np.shape(k)[-1])
  return abs(scale) * float((q @ k.T).max(initial=0.0))


def attention_atol(dtype, head_dim: int, context: int, score_mag: float, value_mag: float, *,
                   roundings: float = 0, score_ops: int = 0) -> float:
  """Bound on ``|x - y|`` between two computations of ``softmax(scale q k^T) v`` (any tiling,
  online or not, split or not), to first order in ``u`` of float32 accumulation.

  One computation: a score (a length-``D`` dot, the scale, the max subtracted, and JAX's
  ``exp2(x log2 e)``) is off by at most ``(D + 4) u S``, which is a relative error of its weight
  ``exp(.)``, plus ``2 u`` for the exp itself: ``rho = (D + 4) u S + 2 u``. The denominator
  ``l`` and the numerator ``sum p_j v_j`` over ``n = context`` keys, with the per-tile and
  per-split rescalings (the same factor on both, so its own error cancels), carry relative
  errors of at most ``rho + 2 n u`` each (relative to ``sum p_j |v_j|``); the division adds
  ``u`` and an ``eps`` guard on ``l`` adds ``2 u``. So ``|error| <= u V (2 (D + 4) S + 4 n + 7)``
  with ``V = max |v|`` over the keys, and two computations differ by twice that:
  ``eps V (2 (D + 4) S + 4 n + 7)``, plus ``roundings * eps_store / 2 * V`` for roundings to a
  bfloat16 storage dtype (weights cast to ``v.dtype`` before ``P V``, the output) over both.

  ``score_ops``: further float32 operations on each score before the softmax (the attention
  knobs, :func:`knob_score_ops`), each a relative error ``u`` of a value of magnitude at most
  ``score_mag`` (which then must include the bias); soft-capping ``c tanh(s / c)`` has slope at
  most 1, so it does not amplify the error of ``s``.
  """
  effective_len = 2 * (head_dim + 4 + score_ops) * score_mag + 4 * context + 7
  return chain_atol(dtype, [effective_len], value_mag, roundings=roundings)


def knob_score_ops(soft_cap=None, alibi_slopes=None) -> int:
  """Roundings (``u`` each) the attention knobs add per score: soft-capping a division, a
  ``tanh`` (within 2 ulp: ``4 u``) and a product, 6; ALiBi a product and a sum, 2 (the position
  difference is exact in int32 and its conversion to float32 exact below ``2**24``)."""
  return (6 if soft_cap is not None else 0) + (2 if alibi_slopes is not None else 0)


def paged_attention_atol(q, pages, layer: int, scale: float, context: int, *,
                         roundings: float = 0, soft_cap=None, alibi_slopes=None) -> float:
  """:func:`attention_atol` for queries ``q [..., D]`` over the K/V of ``pages``' ``layer``: the
  score magnitude over every (query, key) pair and ``max |v|`` over every value in the layer
  (upper bounds for any visible subset), in the pages' dtype. With ALiBi the bias
  ``max |slope| * (context - 1)`` adds to the score magnitude. Soft-capping keeps the uncapped
  magnitude: the score dot's error is made before the cap (which passes it on with slope <= 1)."""
  k = np.asarray(pages[layer, 0], np.float32)
  v = np.asarray(pages[layer, 1], np.float32)
  s = score_magnitude(np.asarray(q, np.float32), k, scale)
  if alibi_slopes is not None:
    s += float(np.abs(np.asarray(alibi_slopes, np.float64)).max()) * max(context - 1, 0)
  return attention_atol(pages.dtype, np.shape(q)[-1], context, s, float(np.abs(v).max()),
                        roundings=roundings, score_ops=knob_score_ops(soft_cap, alibi_slopes))


def layer_matmul_atol(x, w, scale, bias, layer: int) -> float:
  """Bound on ``|a - b|`` between two computations of ``paged_kv.pallas_kernels.layer_matmul`` (the
  kernel and its reference): both accumulate the same K products in float32 in different
  blockings (``K eps32 sum|a_i w_i|`` between them); in a narrow dtype each rounds its sum once
  and adds the bias with one more rounding (two per side)."""
  a = np.asarray(x, np.float64)
  if scale is not None:
    a = a * np.asarray(scale[layer], np.float64)
  mag = float((np.abs(a) @ np.abs(np.asarray(w[layer], np.float64))).max())
  if bias is not None:
    mag += float(np.abs(np.asarray(bias[layer], np.float64)).max())
  return chain_atol(x.dtype, [x.shape[1]], mag, roundings=4 if bias is not None else 2)


def assert_close(actual, desired, atol: float, what: str = "") -> float:
  """Asserts ``max |actual - desired| <= atol`` (compared in float64); returns the ratio of the
  error to ``atol``."""
  a, d = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
  assert a.shape == d.shape, (a.shape, d.shape)
  err = float(np.abs(a - d).max(initial=0.0))
  assert err <= atol, f"{what}: max |error| {err:.4g} > tolerance {atol:.4g} ({err / atol:.3g}x)"
  return err / atol


def llama_reduction_lens(cfg, context: int, score_mag: float, *, num_layers: int | None = None,
                         through: str = "logits") -> list[float]:
  """Reduction lengths ``K_i`` along the Llama forward pass (module docstring), for contexts of
  at most ``context`` positions and attention scores of magnitude at most ``score_mag``
  (:func:`score_bound`).

  ``through="logits"``: all layers, the final norm and the LM head. ``through="kv"``: up to the
  last layer's K/V projections (what the pages hold). ``num_layers`` defaults to
  ``cfg.num_layers``.
  """
  h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
  layers = cfg.num_layers if num_layers is None else num_layers
  norm = h + 2  # mean of squares over hidden, rsqrt, the scale
  proj = h  # q/k/v projection over hidden
  rope = 4  # two products, a sum, cos/sin of the angle
  attn = 2 * (d + 4) * score_mag + 4 * context + 7  # as in attention_atol
  # Family switches (paged_kv.models.config): a bias is one more rounding after its projection; a q/k
  # norm (Qwen3) is an RMSNorm over head_dim between the projection and RoPE.
  offset = getattr(cfg, "norm_offset", False)  # Gemma's (1 + w): one more rounding per norm
  norm += offset
  proj += getattr(cfg, "qkv_bias", False) + (d + 2 + offset) * getattr(cfg, "qk_norm", False)
  # Gemma 2's attention soft cap adds its score operations (knob_score_ops) to the score dot.
  attn += 2 * score_mag * knob_score_ops(getattr(cfg, "attn_soft_cap", None))
  o_add = 1 + getattr(cfg, "o_bias", False)
  mlp_add = getattr(cfg, "mlp_bias", False)
  # The gate activation times up: SiLU (an exp, a sum, a division, the product: 3 counted as
  # before) or GeGLU's tanh GELU (7 products and sums and a tanh within 2 ulp, and the product: 12).
  act = 12 if getattr(cfg, "hidden_act", "silu") == "gelu_pytorch_tanh" else 3
  sandwich = [norm] if getattr(cfg, "sandwich_norm", False) else []  # Gemma's norm on each output
  layer = [norm, proj, rope, attn, cfg.num_heads * d, *sandwich, o_add,  # o_proj (+ bias), residual add
           norm, h + mlp_add, act, f + mlp_add, *sandwich, 1]  # gate/up over hidden, act times up, down, add
  head = [1] if getattr(cfg, "embed_scale", False) else []  # the embedding times sqrt(d)
  if through == "kv":
    return head + layer * (layers - 1) + [norm, proj, rope]
  if through != "logits":
    raise ValueError(f"through must be 'logits' or 'kv', got {through!r}")
  # The final soft cap c tanh(l / c): slope <= 1, so the logits' error passes on, plus its own
  # division, tanh (2 ulp) and product (knob_score_ops' 6).
  cap = [knob_score_ops(getattr(cfg, "final_soft_cap", None))] if getattr(cfg, "final_soft_cap", None) else []
  return head + layer * layers + [norm, h] + cap  # final norm, LM head over hidden


def rope_inv_freq_rtol(rope_scaling) -> float:
  """Relative bound between two float32 computations of the RoPE inverse frequencies
  ``1 / theta ** (2 i / d)`` (plus llama3 scaling), e.g. ours and transformers'.

  The exponent ``2 i / d`` is one correctly rounded IEEE division of the same integers, so it is
  bit-identical in both; ``pow`` is within 1 ulp (``2 u``) and the reciprocal adds ``u``: ``3 u``
  per computation. llama3 scaling (``f = factor``, ``h``/``lo`` = high/low frequency factors): the
  low band divides by ``f`` (``u``). In the medium band the smoothing weight
  ``s = (old_len / wavelen - lo) / (h - lo)``, with ``old_len / wavelen <= h``, is off by at most
  ``h / (h - lo) * (3 u + 4 u) + 2 u`` absolutely (the inverse frequency, ``2 pi / .``,
  ``old_len / .``, the two subtractions and the division), and the result
  ``scaled * (s + (1 - s) / f)`` turns an absolute error ``ds`` into the relative error
  ``(f - 1) ds`` at most (where ``s = 0``), plus ``5 u`` for its own products, sum and division.
  Two computations differ by twice the sum, so ``u`` becomes ``eps`` below.
  """
  e = eps(jnp.float32)
  if rope_scaling is None:
    return 3 * e
  f, h, lo = rope_scaling.factor, rope_scaling.high_freq_factor, rope_scaling.low_freq_factor
  return (3 + 1 + 5) * e + (f - 1) * (h / (h - lo) * 7 + 2) * e


def llama_roundings(cfg) -> int:
  """Roundings to ``cfg.dtype`` along one Llama forward pass in a dtype narrower than float32:
  the embedding row; per layer 20 (each RMSNorm: its float32 result, its scale weight, the
  product; q/k/v, o_proj, gate/up and down: the weight and the output each; RoPE's and the
  attention's outputs; SiLU and its product with up; the two residual adds); the final norm (3)
  and the LM head (weight, output). A float32 model: 0 (part of ``gamma_K``)."""
  if eps(cfg.dtype) <= eps(jnp.float32):
    return 0
  return 1 + 20 * cfg.num_layers + 5


def model_atol(cfg, context: int, magnitude: float, *, score_mag: float,
               num_layers: int | None = None, through: str = "logits", roundings: float = 0) -> float:
  """:func:`chain_atol` over :func:`llama_reduction_lens`, in ``cfg.dtype``: the bound on two
  computations of the logits (or K/V pages) of magnitude ``magnitude``, for contexts of at most
  ``context`` positions and attention scores of magnitude at most ``score_mag``."""
  lens = llama_reduction_lens(cfg, context, score_mag, num_layers=num_layers, through=through)
  return chain_atol(cfg.dtype, lens, magnitude, roundings=roundings)


def _f64(x) -> np.ndarray:
  return np.asarray(x, np.float64)


def _norm_scale(norm) -> np.ndarray:
  """The effective scale of a :class:`paged_kv.models.llama.RMSNorm`: ``w``, or ``1 + w`` for
  Gemma's offset norms."""
  w = _f64(norm.scale[...])
  return 1.0 + w if getattr(norm, "offset", False) else w


def logits_bound(model) -> float:
  """An a-priori bound on ``max |logits|`` of a :class:`paged_kv.models.Llama` from its weights alone:
  the final RMSNorm's output is ``g * x_hat`` with ``||x_hat||_2 <= sqrt(hidden)``, so by
  Cauchy-Schwarz ``|logit_v| <= sqrt(hidden) * ||head_v * g||_2``. Before any final soft cap (which
  only shrinks them)."""
  head = model.embed[...] if model.config.tie_word_embeddings else model.lm_head[...]
  rows = _f64(head) * _norm_scale(model.final_norm)
  return math.sqrt(model.config.hidden_size) * float(np.sqrt((rows ** 2).sum(-1)).max())


def score_bound(model) -> float:
  """An a-priori bound on the attention score magnitude ``S = scale * max sum_i |q_i k_i|`` of a
  :class:`paged_kv.models.Llama` from its weights alone: a head's query is ``W_q,h^T (g * x_hat)`` rotated
  by RoPE (which keeps its norm), ``||x_hat||_2 <= sqrt(hidden)``, and ``sum |q_i k_i| <=
  ||q|| ||k||``, so ``S <= scale * hidden * max_h sigma(diag(g) W_q,h) * max_h sigma(diag(g)
  W_k,h)`` (``sigma``: the largest singular value), the largest over the layers.

  Family switches: a bias ``b_h`` adds at most ``||b_h||`` to a head's norm (triangle inequality);
  a per-head RMSNorm with scale ``g'`` (Qwen3's q/k norm) bounds it by ``sqrt(head_dim) max |g'|``
  whatever came before. Gemma: the norms scale by ``1 + w``, and the softmax scale is
  ``query_pre_attn_scalar ** -0.5``."""
  cfg = model.config
  qpas = getattr(cfg, "query_pre_attn_scalar", None)
  scale = cfg.head_dim ** -0.5 if qpas is None else qpas ** -0.5
  best = 0.0
  for layer in (model.layer(i) for i in range(cfg.num_layers)):
    g = _norm_scale(layer.input_norm)[:, None]
    norms = []
    for which in ("q", "k"):
      w = _f64(getattr(layer.attn, f"{which}_proj")[...])
      n = math.sqrt(cfg.hidden_size) * max(np.linalg.norm(g * w[:, h], 2) for h in range(w.shape[1]))
      if getattr(cfg, "qkv_bias", False):
        n += float(np.sqrt((_f64(getattr(layer.attn, f"{which}_bias")[...]) ** 2).sum(-1)).max())
      if getattr(cfg, "qk_norm", False):
        n = math.sqrt(cfg.head_dim) * float(np.abs(_norm_scale(getattr(layer.attn, f"{which}_norm"))).max())
      norms.append(n)
    best = max(best, scale * norms[0] * norms[1])
  return best


def logprob_atol(logits_atol: float, vocab_size: int) -> float:
  """Two computations of ``log_softmax(logits)[t]`` whose logits differ by at most
  ``logits_atol``: ``logits[t]`` moves by at most ``logits_atol`` and so does the log-sum-exp (its
  gradient, the softmax, sums to 1); the sum of ``vocab_size`` exponentials adds ``vocab_size u``
  relative (absolute in its log), exp and log ``3 u`` (the log's ``u |lse|`` is far below
  ``logits_atol``, which counts ``eps * max|logits|`` hundreds of times): over two computations
  ``2 logits_atol + (vocab_size + 3) eps``."""
  return 2 * logits_atol + (vocab_size + 3) * eps(jnp.float32)


def beam_score_atol(model, context: int, steps: int, score: float) -> float:
  """Beam search scores (a sum of ``steps`` log-probs, divided by ``length ** penalty``) of two
  computations of ``model`` (logits and scores bounded from its weights: :func:`logits_bound`,
  :func:`score_bound`): ``steps`` log-prob errors, the sum's own rounding ``steps u |sum|`` and
  the division ``u |score|``, both computations: ``steps * logprob_atol + (steps + 1) eps |score|``
  (``|score| <= |sum|``)."""
  cfg = model.config
  logits_atol = model_atol(cfg, context, logits_bound(model), score_mag=score_bound(model))
  per_step = logprob_atol(logits_atol, cfg.vocab_size)
  return steps * per_step + (steps + 1) * eps(jnp.float32) * abs(float(score))


# ---------------------------------------------------------------------------- GPT-2 (examples/gpt2.py)
def gpt2_reduction_lens(cfg, context: int, score_mag: float) -> list[float]:
  """Reduction lengths ``K_i`` along the GPT-2 forward pass of ``examples.gpt2`` (``cfg`` a
  ``GPT2Config``), as :func:`llama_reduction_lens` for the Llama. LayerNorm: the mean and the
  variance over ``d`` (``2 d``), the subtraction, rsqrt, scale and bias (5); projections over their
  input width plus the bias add; the tanh GELU ``0.5 x (1 + tanh(c (x + 0.044715 x^3)))``: 7
  products and sums and a tanh within 2 ulp (``4 u``), 11. As for the Llama's RMSNorm, each
  LayerNorm renormalises its input, so a stage's relative error is not amplified beyond order one
  (the pre-norm argument of the module docstring; it assumes the centred input is not tiny
  relative to the input itself)."""
  d, e = cfg.n_embd, cfg.n_embd // cfg.n_head
  norm = 2 * d + 5
  attn = 2 * (e + 4) * score_mag + 4 * context + 7  # as in attention_atol
  layer = [norm, d + 1, attn, d + 1, 1,  # qkv over d + bias, attention, out over heads * e + bias, add
           norm, d + 1, 11, 4 * d + 1, 1]  # fc over d + bias, GELU, proj over 4 d + bias, add
  return layer * cfg.n_layer + [norm, d]  # final LayerNorm, the tied head over d


def _ln_out_norm(ln) -> float:
  """Bound on ``||LayerNorm(x)||_2 = ||g * x_hat + b||`` with ``||x_hat||_2 <= sqrt(d)``."""
  g, b = _f64(ln.scale[...]), _f64(ln.bias[...])
  return math.sqrt(g.size) * float(np.abs(g).max()) + float(np.linalg.norm(b))


def gpt2_score_bound(model) -> float:
  """A-priori bound on the attention score magnitude ``S`` of an ``examples.gpt2.GPT2`` from its
  weights: head ``h``'s query is ``W_q,h^T y + b_q,h`` with ``y`` the LayerNorm output, so
  ``||q_h|| <= sigma(W_q,h) ||y|| + ||b_q,h||`` (likewise keys) and ``S <= scale max ||q_h|| max
  ||k_h||`` (Cauchy-Schwarz), the largest over the layers."""
  best = 0.0
  for block in model.blocks:
    w, bias, y = _f64(block.qkv[...]), _f64(block.qkv_bias[...]), _ln_out_norm(block.ln_1)
    norms = [max(np.linalg.norm(w[:, j, h], 2) * y + np.linalg.norm(bias[j, h]) for h in range(w.shape[2]))
             for j in (0, 1)]
    best = max(best, model.head_dim ** -0.5 * norms[0] * norms[1])
  return best


def gpt2_logits_bound(model) -> float:
  """A-priori bound on ``max |logits|`` of an ``examples.gpt2.GPT2``: ``|wte_v . y| <=
  sqrt(d) ||wte_v * g|| + |wte_v . b|`` for the final LayerNorm's output ``y = g x_hat + b``."""
  wte, g, b = _f64(model.wte[...]), _f64(model.ln_f.scale[...]), _f64(model.ln_f.bias[...])
  rows = np.sqrt(((wte * g) ** 2).sum(-1)) * math.sqrt(g.size) + np.abs(wte @ b)
  return float(rows.max())


def gpt2_atol(model, context: int, magnitude: float) -> float:
  """:func:`chain_atol` over :func:`gpt2_reduction_lens` for a float32 model (its roundings are
  part of ``gamma_K``; narrower dtypes would need their roundings counted)."""
  if model.dtype != "float32":
    raise ValueError(f"gpt2_atol counts no roundings to {model.dtype}; float32 models only")
  lens = gpt2_reduction_lens(model.cfg, context, gpt2_score_bound(model))
  return chain_atol(model.dtype, lens, magnitude, roundings=0)


# ---------------------------------------------------------------------------- quantized KV pages
# The step of e4m3's grid: 3 mantissa bits, so a normal value rounds to nearest within half an ulp,
# 2**-4 of its magnitude; below the smallest normal (2**-6) the spacing is the subnormal step 2**-9,
# so the absolute error is at most 2**-10 (in units of the scale).
E4M3_REL = 2.0 ** -4
E4M3_SUBNORMAL_ABS = 2.0 ** -10


def quant_error_bound(x, dtype) -> np.ndarray:
  """Per-element bound on ``|dequantize(quantize(x)) - x|`` for ``x [..., D]`` quantized per row
  (``paged_kv.pallas_kernels.quant``: ``scale = max|x| / qmax``), as float64 ``[..., D]``.

  int8: ``round(x / scale)`` is within 1/2 of ``x / scale``, so the value within ``scale / 2``
  (saturation never triggers: ``|x| / scale <= qmax``). e4m3: the cast rounds ``x / scale`` to
  within ``2**-4`` of itself (normal range) or ``2**-10`` (subnormal), times ``scale``. Both plus
  the float32 roundings of ``max|x| / qmax``, the division and the product back (``3 u`` of
  ``|x|``, and ``u`` of ``scale * qmax`` for the scale itself)."""
  from paged_kv.pallas_kernels import quant
  x = np.asarray(x, np.float64)
  qmax = quant.QMAX[jnp.dtype(dtype)]
  scale = np.abs(x).max(axis=-1, keepdims=True) / qmax
  u = eps(jnp.float32) / 2
  if jnp.dtype(dtype) == jnp.dtype(jnp.int8):
    step = scale / 2
  else:
    step = E4M3_REL * np.abs(x) + E4M3_SUBNORMAL_ABS * scale
  return step * (1 + 4 * u) + 4 * u * np.abs(x) + u * qmax * scale


def quantized_attention_atol(q, v, k_err, v_err, scale: float, rounding_atol: float) -> float:
  """Bound on ``|attention(q, K^, V^) - attention(q, K, V)|`` when every key row ``K^_j`` differs
  from ``K_j`` by at most ``k_err [..., D]`` elementwise and every value by ``v_err`` (quantized
  pages against the float values they were written from), plus ``rounding_atol`` (the two
  computations' own float rounding, :func:`attention_atol` on either input).

  A score moves by ``|ds_j| <= scale sum_i |q_i| k_err_ji <= eps_s`` (soft-capping has slope
  <= 1; ALiBi adds the same bias to both). Every unnormalised weight ``exp(s_j - m)`` then moves
  by a factor in ``[e^-eps_s, e^eps_s]``, so the normalised weights ``w_j`` by a factor in
  ``[e^-2 eps_s, e^2 eps_s]``: ``sum_j |w^_j - w_j| <= e^(2 eps_s) - 1``, and
  ``|sum_j (w^_j - w_j) v_j| <= (e^(2 eps_s) - 1) max|v|``. The values' own error weighs in
  convexly: ``sum_j w^_j |v^_j - v_j| <= max v_err``. ``q [..., D]``, ``v``, ``k_err``, ``v_err``
  ``[..., D]`` rows (maxima over all of them: an upper bound for any visible subset)."""
  q = np.abs(np.asarray(q, np.float64)).reshape(-1, np.shape(q)[-1])
  k_err = np.asarray(k_err, np.float64).reshape(-1, np.shape(k_err)[-1])
  eps_s = abs(scale) * float((q @ k_err.T).max(initial=0.0))
  v_mag = float(np.abs(np.asarray(v, np.float64)).max(initial=0.0))
  return math.expm1(2 * eps_s) * v_mag + float(np.asarray(v_err, np.float64).max(initial=0.0)) + rounding_atol


def quantized_kernel_atol(q, pages_hat, layer: int, scale: float, context: int, *, roundings: float = 0,
                          soft_cap=None, alibi_slopes=None) -> float:
  """:func:`paged_attention_atol` for a kernel reading quantized pages against attention over the
  explicitly dequantized values ``pages_hat`` (float, ``[L, 2, Hkv, NB, bs, D]``): the same float
  computation except that K's scale multiplies each score (one more score operation, ``u S``)
  and V's scale each probability (one more relative ``u`` on every numerator term: ``eps V``
  over two computations). The int8/e4m3 -> compute dtype conversion is exact."""
  k = np.asarray(pages_hat[layer, 0], np.float64)
  v = np.asarray(pages_hat[layer, 1], np.float64)
  s = score_magnitude(np.asarray(q, np.float64), k, scale)
  if alibi_slopes is not None:
    s += float(np.abs(np.asarray(alibi_slopes, np.float64)).max()) * max(context - 1, 0)
  v_mag = float(np.abs(v).max())
  ops = knob_score_ops(soft_cap, alibi_slopes) + 1
  return (attention_atol(np.asarray(q).dtype, np.shape(q)[-1], context, s, v_mag, roundings=roundings,
                         score_ops=ops) + eps(jnp.float32) * v_mag)
