"""Speculative decoding through the runner's fast path (the CUDA path's code: PagedStage, batched
drafts and acceptance, verify steps in the padded graph layout) run on the CPU (#33): greedy
tokens with drafts equal those without, at PP 1 and 2, in the in-process pipeline (real
Scheduler, StageRunners, DeviceStates; mirrors validated every step), on a tiny random model."""

from __future__ import annotations

import torch

from inproc_pipeline import InprocPipeline
from runtime.bench.gpu_models import model_config, random_tensor
from runtime.model.paged_stage import PagedStage
from runtime.model.stage import StageModel
from runtime.model.tensor_names import stage_tensor_names
from runtime.sampling_params import SamplingParams
from runtime.worker.verify_graphs import VerifyGraphs

MAXLEN, SEQS = 96, 4
PROMPTS = {"cyc": [5, 6, 7, 8] * 5, "rnd": [11, 300, 42, 97, 8, 250, 3, 77, 150, 19]}
MAX_TOKENS = {"cyc": 14, "rnd": 10}


class _OnlyCyc:
    """A stand-in for :class:`ppstate.speculative_probe.NgramProbe` (tests/core/test_speculative_probe.py tests
    the real one): proposals for request "cyc" only, so steps with and without drafts alternate."""

    def has_proposal(self, req, prompt, outputs) -> bool:
        return req.req_id == "cyc"


def stages(ranges):
    cfg = model_config("tiny").model_copy(update={"num_layers": 2})
    out = []
    for r in ranges:
        w = {n: random_tensor(cfg, n, torch.device("cpu"), torch.float32) * (1 if "norm" in n else 8)
             for n in stage_tensor_names(cfg, r)}
        out.append(StageModel(cfg, r, w, max_num_reqs=SEQS, max_model_len=MAXLEN,
                              dtype=torch.float32, device="cpu", batch_invariant=False).eval())
    return out


def run(pp: int, k: int, graphs_layout: bool) -> InprocPipeline:
    ranges = [(0, 2)] if pp == 1 else [(0, 1), (1, 2)]
    pipe = InprocPipeline(stages(ranges), max_num_seqs=SEQS, max_model_len=MAXLEN,
                          num_spec_tokens=k, spec_ngram=2)
    for r in pipe.runners:   # the CUDA worker's fast path, here on the CPU; the runner's
        # ForwardPath (r.fwd) holds its own references since the arch split: set both
        r.fast = r.fwd.fast = PagedStage(r.stage)
        if k and graphs_layout:
            r.verify_graphs = r.fwd.verify_graphs = VerifyGraphs(r.fast, SEQS, MAXLEN // 16,
                                                                 MAXLEN, k)
    if k and graphs_layout:   # the scheduler gives drafts to "cyc"'s rows only (a probe's choice)
        pipe.sched.speculative_probe = _OnlyCyc()
    for rid, p in PROMPTS.items():
        pipe.add(rid, p, SamplingParams(max_tokens=MAX_TOKENS[rid], temperature=0.0,
                                        ignore_eos=True))
    pipe.run_until(lambda p: p.idle, 300)
    return pipe


def test_fast_path_spec_equals_no_spec(monkeypatch):
    """PP=2; K = 3 in the verify graphs' padded layout (steps a graph would replay, run eagerly)
    with the scheduler's n-gram probe (steps with and without drafts), K = 2 in the compact eager
    layout with drafts on every decode row."""
    padded = []
    orig = VerifyGraphs.run
    monkeypatch.setattr(VerifyGraphs, "run", lambda self, vin, **kw: padded.append(vin.num_rows)
                        or orig(self, vin, **kw))
    off = run(2, 0, False).tokens
    for k, layout in ((3, True), (2, False)):
        n = len(padded)
        on = run(2, k, layout)
        assert on.tokens == off, (k, layout)
        assert on.sched.spec_stats()["spec_accepted_tokens"] > 0
        assert (len(padded) > n) == layout
        if layout:   # some steps carried no drafts at all (the plain path)
            drafts = [int((o.num_scheduled_tokens > 1).sum()) for o in on.steps if o.num_rows]
            assert 0 in drafts[2:] and max(drafts) > 0, drafts
