"""The serving scheduler driven by a fake device: host policy without a model or a compile.

``FakeDevice`` has ``DeviceStep``'s four methods. It counts blocks as the block manager does for
rows that share nothing (no prefix cache), and its "sampled" token is a function of the row's
key parts (``100 + 10 * sample_idx + token_idx``), as a real key ``fold_in(seed, sample, token)``
fixes a token whatever the batch: so each sample's expected tokens are known in advance, and any
mistake in the key parts after a preemption or a fork shows up as a wrong token.
"""

import types

import numpy as np
import pytest

from paged_kv.config import ManagerConfig
from paged_kv.engine.sampling import BeamParams, SamplingParams
from paged_kv.engine.scheduler import Scheduler
from paged_kv.engine.serving_step import StepOutputs
from paged_kv.engine.serving_types import Request, ServingConfig
from paged_kv.status import Status

VOCAB = 1000
K = 8


class FakeDevice:
    def __init__(self, mgr: ManagerConfig):
        self.mgr = mgr
        self.lens: dict[int, int] = {}  # row -> tokens with a KV slot
        self.num_free = mgr.num_blocks - 1
        self.admits: list[list[tuple[int, int]]] = []  # per call: (row, prompt length)
        self.steps: list[tuple[object, int]] = []  # (StepInputs, prefill_rows)

    def _blocks(self, n: int) -> int:
        return -(-n // self.mgr.block_size)

    def _free(self, ids) -> None:
        for r in np.asarray(ids).tolist():
            if r >= 0 and r in self.lens:
                self.num_free += self._blocks(self.lens.pop(r))

    def admit(self, free_ids, ids, lens, toks, salts):
        self._free(free_ids)
        status, call = [], []
        for r, n in zip(ids.tolist(), lens.tolist()):
            if r < 0:
                status.append(Status.PADDING)
                continue
            need = self._blocks(n)
            if need > self.num_free:  # first come, first served: later ones fail too
                status.append(Status.NO_FREE_BLOCKS)
                continue
            self.lens[r] = n
            self.num_free -= need
            status.append(Status.OK)
            call.append((r, n))
        self.admits.append(call)
        zeros = np.zeros(len(ids), np.int32)
        return np.array(status, np.int32), zeros, zeros, self.num_free

    def step(self, inp, prefill_rows: int):
        self.steps.append((inp, prefill_rows))
        r = self.mgr.max_seqs
        self._free(inp.free_ids)
        before = dict(self.lens)
        for d, p in zip(inp.sel_dst.tolist(), inp.sel_parent.tolist()):
            if d >= 0:  # beams of one family have equal lengths: the count does not change
                self.lens[d] = before[p]
        status = np.full((r,), Status.PADDING, np.int32)
        for row in np.flatnonzero(inp.dec_live).tolist():
            n = self.lens[row]
            if n % self.mgr.block_size == 0:
                if self.num_free == 0:
                    status[row] = Status.NO_FREE_BLOCKS
                    continue
                self.num_free -= 1
            self.lens[row] = n + 1
            status[row] = Status.OK
        for s, d in zip(inp.fork_src.tolist(), inp.fork_dst.tolist()):
            if s >= 0:
                self.lens[d] = self.lens[s]
                self.num_free -= self._blocks(self.lens[s])
        tokens = (100 + 10 * inp.sample_idx + inp.token_idx).astype(np.int32)
        top_ids = np.tile(np.arange(1, K + 1, dtype=np.int32), (r, 1))
        top_lp = np.tile(-np.arange(1, K + 1, dtype=np.float32), (r, 1))
        empty = np.zeros((0, 0), np.int32)
        return StepOutputs(tokens=tokens, logprobs=np.full((r,), -0.5, np.float32), top_logprobs=top_lp,
                           top_ids=top_ids, status=status, num_free=np.int32(self.num_free), copies=np.int32(0),
                           tables=empty, num_tokens=np.zeros((0,), np.int32), refs=empty, bad_tokens=np.int32(0))

    def free(self, free_ids) -> int:
        self._free(free_ids)
        return self.num_free

    def cache_stats(self):
        return types.SimpleNamespace(lookups=0, query_tokens=0, hit_tokens=0, evictions=0)


def make(num_blocks=64, max_seqs=4, block_size=4, max_prefill_rows=4):
    mgr = ManagerConfig(num_blocks=num_blocks, block_size=block_size, max_seqs=max_seqs, max_blocks_per_seq=16)
    cfg = ServingConfig(mgr, chunk_size=8, max_prefill_rows=min(max_prefill_rows, max_seqs), top_candidates=K,
                        record_tables=False)
    dev = FakeDevice(mgr)
    return Scheduler(cfg, dev, vocab_size=VOCAB, max_positions=64), dev


def drain(sched, limit=200):
    outs = {}
    for _ in range(limit):
        for o in sched.step():
            outs[o.request_id] = o
        if sched.idle:
            for o in sched.step():  # flush the last frees
                outs[o.request_id] = o
            return outs
    raise AssertionError("scheduler did not finish")


def expected(sample: int, n_tokens: int) -> list[int]:
    return [100 + 10 * sample + t for t in range(n_tokens)]


def test_samples_fork_after_prefill_and_get_their_own_key_parts():
    sched, dev = make()
    sched.submit(Request((1, 2, 3, 4, 5), SamplingParams(max_new_tokens=6, n=3), request_id="a"))
    outs = drain(sched)
    a = outs["a"]
    assert a.tokens == [expected(j, 6) for j in range(3)]
    assert a.finish_reasons == ["length"] * 3
    # One admission of one row; the prefill step forks its two other samples.
    assert dev.admits[0] == [(0, 5)]
    inp, p = dev.steps[0]
    assert p == sched.config.max_prefill_rows
    assert inp.fork_src.tolist()[:2] == [0, 0] and sorted(inp.fork_dst.tolist()[:2]) == [1, 2]
    assert all(p == 0 for _, p in dev.steps[1:])  # later steps run the decode-only variant
    assert sched.stats().generated_tokens == 18


def test_eos_ends_a_sample_and_frees_its_row():
    sched, dev = make()
    sched.submit(Request((7, 7), SamplingParams(max_new_tokens=10, eos_token_ids=(102,)), request_id="e"))
    outs = drain(sched)
    assert outs["e"].tokens == [[100, 101, 102]] and outs["e"].finish_reasons == ["eos"]
    assert dev.lens == {}  # every row was freed
    assert dev.num_free == sched.manager.num_blocks - 1


def test_rows_limit_admission_first_come_first_served():
    sched, dev = make(max_seqs=4)
    sched.submit(Request((1,) * 3, SamplingParams(max_new_tokens=4, n=3), request_id="x"))
    sched.submit(Request((2,) * 3, SamplingParams(max_new_tokens=4, n=3), request_id="y"))
    sched.step()
    assert sched.num_running == 1 and sched.num_waiting == 1  # y needs 3 rows; 1 is free
    outs = drain(sched)
    assert outs["x"].tokens == outs["y"].tokens == [expected(j, 4) for j in range(3)]
    assert outs["y"].stats.first_token_step > outs["x"].stats.finish_step  # admitted once x freed its rows


def test_preemption_recomputes_and_keeps_the_tokens():
    # 4 allocatable blocks of 4 tokens: two 4-token prompts fill two; the 5th position of each
    # takes the other two; the 9th finds none: the newest request is preempted and re-admitted
    # later with its generated tokens appended to its prompt.
    sched, dev = make(num_blocks=5, max_seqs=2, block_size=4)
    sched.submit(Request((1, 2, 3, 4), SamplingParams(max_new_tokens=8), request_id="old"))
    sched.submit(Request((5, 6, 7, 8), SamplingParams(max_new_tokens=8), request_id="new"))
    outs = drain(sched)
    assert outs["old"].stats.preemptions == 0 and outs["new"].stats.preemptions == 1
    assert outs["old"].tokens == outs["new"].tokens == [expected(0, 8)]
    assert sched.stats().preemptions == 1 and outs["new"].stats.admissions == 2
    readmit = [c for c in dev.admits[1:] if c]
    assert len(readmit) == 1 and readmit[0][0][1] > 4  # prompt + tokens generated before preemption
    generated_before = readmit[0][0][1] - 4
    assert generated_before == 5  # token 0 from the prefill, tokens 1-4 at positions 4..7


def test_beams_rank_select_and_finish():
    sched, dev = make()
    sched.submit(Request((3, 3, 3), BeamParams(beam_width=2, max_new_tokens=3), request_id="b"))
    out = drain(sched)["b"]
    # Every row's candidates are ids 1..8 with log-probabilities -1..-8; ties break by (parent, token).
    assert out.tokens == [[1, 1, 1], [1, 1, 2]]
    assert out.scores == pytest.approx([-1.0, -4 / 3])
    # The second beam (row 1) took its parent's table (row 0) by a select after the first token.
    selects = [(d, p) for inp, _ in dev.steps for d, p in zip(inp.sel_dst.tolist(), inp.sel_parent.tolist())
               if d >= 0]
    assert (1, 0) in selects


def test_streaming_deltas_add_up_to_the_outputs():
    sched, _ = make(num_blocks=5, max_seqs=2, block_size=4)
    sched.host.deltas = []  # what ServingEngine.run(on_token=...) does
    sched.submit(Request((1, 2, 3, 4), SamplingParams(max_new_tokens=8), request_id="p"))
    sched.submit(Request((5, 6, 7, 8), SamplingParams(max_new_tokens=8, n=1), request_id="q"))
    outs = drain(sched)
    got: dict = {}
    for d in sched.host.deltas:
        got.setdefault((d.request_id, d.index), []).extend(d.tokens)
    assert got == {("p", 0): outs["p"].tokens[0], ("q", 0): outs["q"].tokens[0]}
    assert sum(o.stats.preemptions for o in outs.values()) == 1  # streamed once despite the preemption


def test_collaborators_are_held_not_inherited():
    """The scheduler holds its collaborators (the device, ``Outcomes``, one shared ``HostState``)
    and the serving engine holds the scheduler; the engine's public API is what it was when it
    inherited it (checked by name, without a model)."""
    from paged_kv.engine.families import HostState
    from paged_kv.engine.outcomes import Outcomes
    from paged_kv.engine.serving import ServingEngine

    assert Scheduler.__bases__ == (object,) and Outcomes.__bases__ == (object,)
    assert ServingEngine.__bases__ == (object,)
    sched = Scheduler(ServingConfig(ManagerConfig(num_blocks=9, block_size=4, max_seqs=4, max_blocks_per_seq=4),
                                    chunk_size=4, max_prefill_rows=2), object(), vocab_size=10, max_positions=64)
    assert isinstance(sched.host, HostState) and sched.outcomes.host is sched.host
    sched.step_count = 5
    assert sched.host.step_count == 5
    api = {"config", "manager", "device", "vocab_size", "max_positions", "context", "step_count", "snapshot",
           "compile_table", "idle", "num_waiting", "num_running", "blocks_in_use", "preemptions", "check", "submit",
           "reject", "step", "stats", "pages", "state", "programs", "compile", "run"}
    missing = [name for name in api if not hasattr(ServingEngine, name) and name not in ("device", "compile_table")]
    assert not missing, missing
    assert isinstance(ServingEngine.step_count, property) and ServingEngine.step_count.fset is not None


def test_abort_frees_rows_through_the_next_step_and_ids_stay_unique():
    """``abort``: a running request's rows are in the next step's ``free_ids`` (the jitted free
    path finished requests take), a waiting one just leaves the queue; both come out of that step
    as "aborted" with a last delta per unfinished sample; nothing is left held. A live id cannot
    be submitted twice; an unknown or finished one aborts nothing."""
    sched, dev = make(num_blocks=64, max_seqs=3, block_size=4)
    sched.host.deltas = []
    sched.submit(Request((1, 2, 3), SamplingParams(max_new_tokens=8, n=2), request_id="run"))
    sched.submit(Request((9, 9), SamplingParams(max_new_tokens=8), request_id="keep"))
    sched.submit(Request((4, 5, 6), SamplingParams(max_new_tokens=8, n=2), request_id="wait"))  # no rows left
    with pytest.raises(ValueError, match="request id 'run' is already in use"):
        sched.submit(Request((7,), SamplingParams(max_new_tokens=2), request_id="run"))
    sched.step()
    sched.step()
    rows = sorted(sched.host.live["run"].rows)
    assert len(rows) == 2 and sched.num_waiting == 1
    assert sched.abort("run") and sched.abort("wait") and not sched.abort("run") and not sched.abort("nobody")
    done = sched.step()
    assert sorted(o.request_id for o in done) == ["run", "wait"]
    assert all(o.finish_reasons == ["aborted", "aborted"] for o in done)
    assert sorted(r for r in dev.steps[-1][0].free_ids.tolist() if r >= 0) == rows
    assert set(dev.lens) == {sched.host.live["keep"].rows[0]}  # only the other request holds blocks
    assert drain(sched)["keep"].tokens == [expected(0, 8)]
    assert dev.lens == {} and dev.num_free == sched.manager.num_blocks - 1
    last = [(d.request_id, d.index, d.finish_reason) for d in sched.host.deltas if d.finish_reason == "aborted"]
    assert sorted(last) == [("run", 0, "aborted"), ("run", 1, "aborted"), ("wait", 0, "aborted"),
                            ("wait", 1, "aborted")]
    assert sched.stats().aborted == 2 and sched.stats().finished == 1
    sched.submit(Request((1, 2, 3), SamplingParams(max_new_tokens=2), request_id="run"))  # the id is free again
    assert drain(sched)["run"].finish_reasons == ["length"]


def test_max_new_tokens_past_the_context_ends_length_capped():
    """The context is 64 tokens (``make``): a 60-token prompt gets 64 - 60 + 1 = 5 new tokens, and
    samples and beam hypotheses cut there say "length_capped" (exactly 5 asked: "length")."""
    sched, _ = make()
    sched.submit(Request((1,) * 60, SamplingParams(max_new_tokens=8, n=2), request_id="s"))
    sched.submit(Request((2,) * 60, SamplingParams(max_new_tokens=5), request_id="exact"))
    sched.submit(Request((3,) * 60, BeamParams(beam_width=2, max_new_tokens=8), request_id="b"))
    outs = drain(sched)
    assert outs["s"].tokens == [expected(j, 5) for j in range(2)]
    assert outs["s"].finish_reasons == ["length_capped"] * 2
    assert outs["exact"].finish_reasons == ["length"]
    assert [len(t) for t in outs["b"].tokens] == [5, 5] and outs["b"].finish_reasons == ["length_capped"] * 2
