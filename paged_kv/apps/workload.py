"""The built-in workload of the main job: its requests (``build_workload``: prompts from the
built-in tiny model's domain, some sharing a Q&A preamble, some with ``n = 4`` samples or a beam
search of width 4, arriving over time), serving them with a progress bar (``serve_workload``), and
printing a few of their answers (``print_outputs``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from paged_kv.apps.interrupt import phase

if TYPE_CHECKING:  # the engine and models load on first use: `--help` imports no JAX
    from paged_kv.engine.serving import Request
    from paged_kv.models.hf_tokenizer import HFTokenizer
    from paged_kv.models.tokenizer import ByteTokenizer

PREAMBLE = ("Q: What does the cow say? A: The cow says moo. "
            "Q: Where does the duck live? A: The duck lives in the pond. ")

# (prompt, kind): kind is "greedy", "sample" (one answer, temperature 0.7), "n4" (four answers,
# temperature 0.8, top-p 0.95) or "beam4" (beam search of width 4).
TEMPLATES = [
    ("Once upon a time there was a", "greedy"),
    (PREAMBLE + "Q: What color is a banana? A:", "greedy"),
    ("The cow says", "n4"),
    ("Let us count: 12, 13,", "greedy"),
    (PREAMBLE + "Q: Where does the owl live? A:", "sample"),
    ("The cow says", "beam4"),
    ("After Monday comes", "greedy"),
    (PREAMBLE + "Q: What day comes after Friday? A:", "greedy"),
    ("Once upon a time there was a brave lion named Rosa.", "n4"),
    ("3 plus 4 is", "greedy"),
    (PREAMBLE + "Q: What does the lion say? A:", "beam4"),
    ("Count with me: two, three,", "sample"),
]


def build_workload(tokenizer: ByteTokenizer | HFTokenizer, num_requests: int, max_new_tokens: int, arrival_gap: int,
                   eos_id: int | Sequence[int]) -> list[Request]:
    """The ready-made requests (ids ``0 .. num_requests - 1``, arrival ``i * arrival_gap``).
    ``eos_id``: the EOS id, or a sequence of them (every one ends an answer)."""
    from paged_kv.engine import BeamParams, SamplingParams
    from paged_kv.engine.serving import Request

    eos = tuple(int(t) for t in eos_id) if isinstance(eos_id, (list, tuple)) else (int(eos_id),)
    kinds = {
        "greedy": SamplingParams(max_new_tokens=max_new_tokens, eos_token_ids=eos),
        "sample": SamplingParams(max_new_tokens=max_new_tokens, temperature=0.7, eos_token_ids=eos),
        "n4": SamplingParams(max_new_tokens=max_new_tokens, temperature=0.8, top_p=0.95, n=4, eos_token_ids=eos),
        "beam4": BeamParams(beam_width=4, max_new_tokens=max_new_tokens, eos_token_ids=eos),
    }
    reqs = []
    for i in range(num_requests):
        text, kind = TEMPLATES[i % len(TEMPLATES)]
        reqs.append(Request(tokenizer.encode(text, add_bos=True), kinds[kind], arrival=i * arrival_gap,
                            request_id=i))
    return reqs


def short(text: str, limit: int = 60) -> str:
    text = text.replace(PREAMBLE, "<Q&A preamble> ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def workload_notes(reqs, prompts, context: int, limit: str) -> list[str]:
    """The built-in workload's requests that cannot run (said before compiling; they are still
    submitted, and rejected with the engine's reason). ``context``: tokens a sequence holds;
    ``limit``: what sets it (``sequence_context``)."""
    if prompts is not None:
        return []
    long = [q for q in reqs if len(q.prompt) > context]
    if not long:
        return []
    return [f"{len(long)} of {len(reqs)} requests have prompts longer than the {context} tokens a sequence holds "
            f"({limit}): they will be rejected"]


def _describe(req) -> str:
    p = req.params
    if req.is_beam:
        return f"beam search, width {p.beam_width}"
    if p.temperature == 0:
        return "greedy" if p.n == 1 else f"greedy, n={p.n}"
    return (f"n={p.n}, " if p.n > 1 else "") + f"temperature {p.temperature:g}" + \
        (f", top-p {p.top_p:g}" if p.top_p < 1 else "")


def _pick_outputs(outputs, count: int):
    """A greedy answer, a parallel-sampling request and a beam request with the same prompt, then others."""
    ok = [o for o in outputs if o.ok]
    picked = []
    greedy = [o for o in ok if not o.request.is_beam and o.request.width == 1 and o.request.params.temperature == 0]
    beams = [o for o in ok if o.request.is_beam]
    multi = [o for o in ok if not o.request.is_beam and o.request.width > 1]
    if greedy:
        picked.append(greedy[0])
    if beams:
        twin = [o for o in multi if o.request.prompt == beams[0].request.prompt]
        picked += (twin[:1] or multi[:1]) + [beams[0]]
    elif multi:
        picked.append(multi[0])
    picked += [o for o in ok if o not in picked]
    return picked[:count]


def shown_tokens(tokenizer, ids, limit: int, *, as_text: bool = True) -> str:
    """Text of ``ids`` (quoted) when ``tokenizer`` can decode them, else the token ids themselves
    (a model whose vocabulary is not byte-level generates ids the byte tokenizer has no text for)."""
    ids = [int(t) for t in ids]
    if tokenizer is not None and as_text:
        try:
            return repr(short(tokenizer.decode(ids, stop_at_eos=True), limit))
        except (ValueError, TypeError, OverflowError):
            pass
    eos = getattr(tokenizer, "eos_id", None)
    if eos in ids:
        ids = ids[: ids.index(eos)]
    text = " ".join(map(str, ids))
    return f"token ids [{text if len(text) <= limit else text[: limit - 3] + '...'}]"


def print_outputs(outputs, tokenizer, count: int, *, as_text: bool = True) -> None:
    """A few answers; ``as_text=False`` (or ids the tokenizer cannot decode): token ids."""
    for o in _pick_outputs(outputs, count):
        prompt = shown_tokens(tokenizer, o.request.prompt, 60)
        print(f"\n[request {o.request_id}: {_describe(o.request)}; {o.stats.preemptions} preemptions, "
              f"{o.stats.cached_prompt_tokens} prompt tokens from cache]  {prompt}")
        for j, toks in enumerate(o.tokens):
            text = shown_tokens(tokenizer, toks, 90, as_text=as_text)
            tag = f"beam {j} (score {o.scores[j]:.3f})" if o.scores is not None else f"sample {j}"
            print(f"    {tag}: {text}")


def serve_workload(engine, reqs, args, outputs: list) -> None:
    """Serves the workload with a progress bar (and, with ``--verbose``, a line per finished
    request); appends each output to ``outputs`` as it finishes."""
    from tqdm import tqdm

    from paged_kv.apps.progress import BAR_STEADY, BAR_WARMING, SteadyRate

    bar = tqdm(total=len(reqs), unit="req", desc="serving", file=sys.stderr, disable=args.no_progress,
               dynamic_ncols=True, bar_format=BAR_WARMING)
    rate = SteadyRate()

    def on_step(eng):
        if not rate.steady and rate.observe(time.perf_counter()):
            bar.bar_format = BAR_STEADY  # an ETA only now: steps run at a steady rate
        if eng.step_count % 5 == 0:
            bar.set_postfix(step=eng.step_count, running=eng.num_running, waiting=eng.num_waiting,
                            blocks=eng.blocks_in_use, preempted=eng.preemptions, refresh=False)
            bar.refresh()

    try:
        for out in engine.run(reqs, on_step=on_step):  # streamed as each request finishes
            outputs.append(out)
            phase("served")
            bar.update(1)
            if out.error is not None:
                bar.write(f"request {out.request_id:>3} rejected: {out.error}")
                continue
            if not args.verbose:
                continue
            st = out.stats
            ttft = "–" if st.time_to_first_token_s is None else f"{st.time_to_first_token_s:.2f} s"
            bar.write(f"request {out.request_id:>3} done at step {st.finish_step:4d}: {_describe(out.request):<34} "
                      f"{st.prompt_tokens:4d} prompt tokens, {st.cached_prompt_tokens:3d} tokens from cache in "
                      f"{st.admissions} admission{'s' if st.admissions > 1 else ''}, "
                      f"{st.generated_tokens:4d} generated, {st.preemptions} preemptions, "
                      f"first token after {ttft}")
    finally:
        bar.close()  # an error after it starts on a line of its own


__all__ = ["PREAMBLE", "TEMPLATES", "build_workload", "print_outputs", "serve_workload", "short", "shown_tokens",
           "workload_notes"]
