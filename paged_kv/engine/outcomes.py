"""What the serving scheduler does with one step's outputs: each produced row's token goes to its
sample (or its top candidates to its beam family, ranked once every beam of the family has them),
samples and families finish, rows are released, tokens are queued for streaming, and a failed
``append`` preempts the newest running request (by recompute: it goes back to the front of the
waiting queue with its generated tokens).

``Outcomes`` is one of ``engine.scheduler.Scheduler``'s collaborators: both hold the same
``families.HostState`` (queues, rows, pending tokens, statistics, streamed deltas), and the
scheduler hands each step's outputs to ``Outcomes.process``.
"""

from __future__ import annotations

import time

import numpy as np

from paged_kv.engine import families as F
from paged_kv.engine.families import Beam, Family, HostState, Phase, Sample
from paged_kv.engine.serving_step import StepOutputs
from paged_kv.engine.serving_types import TokenDelta
from paged_kv.status import Status


class Outcomes:
    """Processing of ``StepOutputs`` (host numpy) for ``Scheduler``, on the ``HostState`` both hold.

    Args:
      host: the scheduler's ``HostState`` (shared, not copied).
      vocab_size: the model's vocabulary (beam ranking's tie breaking).
    """

    def __init__(self, host: HostState, vocab_size: int):
        self.host, self.vocab_size = host, vocab_size

    def process(self, out: StepOutputs, pf: tuple | None) -> None:
        """One step's outputs (``pf``: its prefill pieces, ``build_inputs``' second result, or None)."""
        now = time.perf_counter()
        st = self.host.stats
        produced: list[int] = []  # rows whose logits are valid this step
        # Decoding rows.
        failed = []
        status = out.status.tolist()  # Python ints once, not a numpy scalar per row
        for row in list(self.host.pending):
            if status[row] == Status.OK:
                del self.host.pending[row]
                produced.append(row)
            elif status[row] == Status.TABLE_FULL:  # cannot happen within the budget; end the row
                del self.host.pending[row]
                fam, _ = self.host.row_owner[row]
                self._end_row_table_full(fam, row)
            else:
                failed.append(row)
        # Rows whose prefill ended.
        if pf is not None:
            st.prefill_steps += 1
            st.prefill_tokens += int(np.sum(pf[3]))
            for cr, start, q, end in zip(pf[5], pf[2].tolist(), pf[3].tolist(), pf[4]):
                cr.done = start + q
                if not end:
                    continue
                if cr.discard:
                    self.host.to_free.append(cr.row)
                    self.host.free_rows.append(cr.row)
                    self.host.free_rows.sort()
                    continue
                produced.append(cr.row)
                produced.extend(cr.fork_to)
                cr.family.prefilling.discard(cr.row)
            if all(cr.done >= len(cr.tokens) for cr in self.host.cohort):
                self.host.cohort = []
        beam_fams = {}
        tokens, logprobs = out.tokens.tolist(), out.logprobs.tolist()
        for row in produced:
            owner = self.host.row_owner.get(row)
            if owner is None or owner[0].phase is not Phase.RUNNING:
                continue  # released while processing this step (its request ended)
            fam = owner[0]
            if fam.req.is_beam:
                self.host.results[row] = (out.top_logprobs[row], out.top_ids[row])
                beam_fams[fam.seq] = fam
            else:
                self._emit_sample(fam, row, tokens[row], logprobs[row], now)
        for fam in beam_fams.values():
            self._maybe_choose(fam, now)
        if failed:
            self._preempt_newest()

    def process_burst(self, outs: list[StepOutputs]) -> bool:
        """A decode burst's ``K`` steps (``outs``, no prefill) at once: each row's tokens up to its
        end go to its sample in one list operation, then the rows that ended finish in the order
        ``process`` would have finished them one step at a time (by step, then by row order), with
        the engine's clock at their step. The result is the same as ``process`` on each step in
        turn; the host work per burst is a few numpy calls and one pass over the rows, not one
        pass per step (at 32 rows, about 9 ms of a 120 ms run goes to ``process``).

        Returns False, changing nothing, unless every row of the burst is a running sample whose
        first token is out, each step it ran is OK, and nothing streams deltas (their per-step
        order is kept by ``process``); the caller then processes the steps one at a time.
        Leaves ``host.step_count`` at its value plus ``K``."""
        host = self.host
        if host.deltas is not None:
            return False
        k, base = len(outs), host.step_count
        status = np.stack([o.status for o in outs])  # [K, R]
        tokens = np.stack([o.tokens for o in outs])
        plan = []  # (end step, row order, family, sample, row, tokens taken, finishes)
        for order, row in enumerate(host.pending):
            owner = host.row_owner.get(row)
            if owner is None or owner[0].phase is not Phase.RUNNING:
                return False
            fam = owner[0]
            if fam.req.is_beam or fam.stats.first_token_step is None:
                return False
            s = next(s for s in fam.samples if s.row == row)
            eos = np.flatnonzero(np.isin(tokens[:, row], fam.req.params.eos_token_ids))
            end = min(fam.budget - len(s.tokens) - 1, int(eos[0]) if eos.size else k)
            finishes = end < k
            n = end + 1 if finishes else k
            if (status[:n, row] != Status.OK).any():
                return False
            plan.append((end, order, fam, s, row, n, finishes))
        logprobs = np.stack([o.logprobs for o in outs])
        now = time.perf_counter()
        host.pending.clear()
        for _, _, _, s, row, n, finishes in plan:
            s.tokens.extend(tokens[:n, row].tolist())
            s.logprobs.extend(logprobs[:n, row].tolist())
            host.stats.generated_tokens += n
            if not finishes:
                host.pending[row] = s.tokens[-1]
        for end, _, fam, s, row, _, _ in sorted((p for p in plan if p[-1]), key=lambda p: p[:2]):
            host.step_count = base + end + 1
            s.finish = "eos" if s.tokens[-1] in fam.req.params.eos_token_ids else fam.length_reason()
            s.row = None
            self._release_row(fam, row)
            if all(x.finish is not None for x in fam.samples):
                self._finish(fam, now)
        host.step_count = base + k
        return True

    def _first_token(self, fam: Family, now: float) -> None:
        if fam.stats.first_token_step is None:
            fam.stats.first_token_step = self.host.step_count
            fam.stats.time_to_first_token_s = now - fam.t_submit

    def _emit_sample(self, fam: Family, row: int, tok: int, logp: float, now: float) -> None:
        s = next(s for s in fam.samples if s.row == row)
        self._first_token(fam, now)
        s.tokens.append(tok)
        s.logprobs.append(logp)
        self.host.stats.generated_tokens += 1
        eos = tok in fam.req.params.eos_token_ids
        if eos or len(s.tokens) >= fam.budget:
            s.finish = "eos" if eos else fam.length_reason()
            s.row = None
            self._stream_sample(fam, s)
            self._release_row(fam, row)
            if all(x.finish is not None for x in fam.samples):
                self._finish(fam, now)
        else:
            self._stream_sample(fam, s)
            self.host.pending[row] = tok

    def _stream_sample(self, fam: Family, s: Sample) -> None:
        """Queue the sample's tokens not yet streamed (with its finish reason once it ended)."""
        if self.host.deltas is None:
            return
        new = tuple(s.tokens[s.streamed:])
        if new or s.finish is not None:
            self.host.deltas.append(TokenDelta(fam.rid, fam.samples.index(s), new, s.finish))
            s.streamed = len(s.tokens)

    def _end_row_table_full(self, fam: Family, row: int) -> None:
        now = time.perf_counter()
        if fam.req.is_beam:
            self._finish_beams(fam, now, final=True)
            return
        s = next(s for s in fam.samples if s.row == row)
        s.finish, s.row = "length", None
        self._stream_sample(fam, s)
        self._release_row(fam, row)
        if all(x.finish is not None for x in fam.samples):
            self._finish(fam, now)

    def _release_row(self, fam: Family, row: int) -> None:
        self.host.to_free.append(row)
        self.host.pending.pop(row, None)
        self.host.results.pop(row, None)
        self.host.row_owner.pop(row, None)
        if row in fam.rows:
            fam.rows.remove(row)
        self.host.free_rows.append(row)
        self.host.free_rows.sort()

    # -- beam search (host side; the algorithm of engine.beam_search) -------------------------
    def _maybe_choose(self, fam: Family, now: float) -> None:
        p = fam.req.params
        k = p.beam_width
        live = fam.beams if fam.beams else [Beam(tokens=[], score=0.0, row=fam.rows[0])]
        if any(b.row not in self.host.results for b in live):
            return  # some beam still waits for its forward (prefill or a retried append)
        self._first_token(fam, now)
        finished, keep, length = F.rank_beams(live, [self.host.results.pop(b.row) for b in live], p, self.vocab_size)
        if length >= fam.budget:
            finished += [(val, live[i].tokens + [tok], length) for val, i, tok in keep]
        F.merge_pool(fam, finished, p.length_penalty)
        self.host.stats.generated_tokens += len(keep)
        if length >= fam.budget or len(fam.pool) >= k or len(keep) < k:
            fam.beams = [Beam(live[i].tokens + [tok], val) for val, i, tok in keep]
            self._finish_beams(fam, now, final=False)
            return
        # New beams take rows: beam j -> fam.rows[j]; its table is its parent's (select next step).
        parents = [live[i].row for _, i, _ in keep]
        fam.beams = [Beam(live[i].tokens + [tok], val, row=fam.rows[j]) for j, (val, i, tok) in enumerate(keep)]
        for j, b in enumerate(fam.beams):
            self.host.select.append((b.row, parents[j]))
            self.host.pending[b.row] = b.tokens[-1]

    def _finish_beams(self, fam: Family, now: float, *, final: bool) -> None:
        if final:  # out of table: the live beams are hypotheses of their current length
            F.merge_pool(fam, [(b.score, b.tokens, len(b.tokens)) for b in fam.beams if b.tokens],
                         fam.req.params.length_penalty)
        for row in list(fam.rows):
            self._release_row(fam, row)
        self._finish(fam, now)

    # -- finishing and preemption ---------------------------------------------------------
    def _finish(self, fam: Family, now: float) -> None:
        for row in list(fam.rows):  # reserved rows never used (a sample family finishing early)
            self._release_row(fam, row)
        fam.phase = Phase.DONE
        self.host.running.pop(fam.seq, None)
        self.host.live.pop(fam.rid, None)  # its id may be used again
        fam.stats.finish_step = self.host.step_count
        fam.stats.latency_s = now - fam.t_submit
        if fam.aborted:
            self.host.stats.aborted += 1
        else:
            self.host.stats.finished += 1
        out = F.family_output(fam)
        if self.host.deltas is not None and fam.req.is_beam:
            self.host.deltas.extend(TokenDelta(fam.rid, j, tuple(t), reason)
                                for j, (t, reason) in enumerate(zip(out.tokens, out.finish_reasons)))
        self.host.finished.append(out)

    def abort(self, fam: Family) -> None:
        """Ends ``fam`` (waiting or running) now: its output (unfinished samples ``"aborted"``; a
        beam request's live beams join its hypotheses) goes to ``finished`` with the last deltas.

        Its rows go to ``to_free`` (``_release_row``), so the next step's jitted ``free`` releases
        their blocks, tail first, full ones kept in the prefix cache, exactly as for a finished
        request. A row still in the cohort is the exception: ``admit`` registered its full blocks
        in the prefix cache before their K/V is written, and other prompts of the cohort may read
        them (``CohortRow.reads_cohort``), so it is prefilled to its end as a discarded row (as
        after a failed admission) and freed then; the rows its samples would fork into are freed
        now, and the fork is dropped."""
        now = time.perf_counter()
        fam.aborted = True
        if fam.phase is Phase.WAITING:
            self.host.waiting.remove(fam)  # holds no row: a preempted family released them all
        for cr in self.host.cohort:
            # Only rows still prefilling: a row whose prefill ended decodes, and is released below
            # (the cohort can outlive it while a cohort mate's prompt is still being prefilled).
            if cr.family is fam and not cr.discard and cr.row in fam.prefilling:
                cr.discard, cr.fork_to = True, []
                fam.rows.remove(cr.row)
                self.host.row_owner.pop(cr.row, None)
        fam.prefilling.clear()
        for row in list(fam.rows):
            self._release_row(fam, row)
        # Beam reselections into its rows are void (the rows are free now).
        self.host.select = [(d, p) for d, p in self.host.select if d in self.host.row_owner]
        for s in fam.samples:
            s.row = None
            if s.finish is None:
                s.finish = "aborted"
                self._stream_sample(fam, s)
        if fam.beams:
            F.merge_pool(fam, [(b.score, b.tokens, len(b.tokens)) for b in fam.beams if b.tokens],
                         fam.req.params.length_penalty)
            for b in fam.beams:
                b.row = None
        self._finish(fam, now)

    def _preempt_newest(self) -> None:
        """Preempt the newest running request that is not in the middle of its prefill."""
        cands = [f for f in self.host.running.values() if not f.prefilling]
        if not cands:
            return
        fam = max(cands, key=lambda f: f.seq)
        for row in list(fam.rows):
            self._release_row(fam, row)
        for s in fam.samples:
            s.row = None
        for b in fam.beams:
            b.row = None
        self.host.select = [(d, p) for d, p in self.host.select if self.host.row_owner.get(d, (None,))[0] is not None]
        fam.phase = Phase.WAITING
        fam.stats.preemptions += 1
        self.host.stats.preemptions += 1
        self.host.running.pop(fam.seq)
        # Front of the queue, but behind older preempted requests already there.
        i = 0
        waiting = self.host.waiting
        while i < len(waiting) and waiting[i].stats.preemptions > 0 and waiting[i].seq < fam.seq:
            i += 1
        self.host.waiting.insert(i, fam)
