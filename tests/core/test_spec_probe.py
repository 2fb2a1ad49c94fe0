"""The scheduler's n-gram probe (ppstate/spec_probe.py, #33) says "proposal" exactly when the
prompt-lookup proposer finds a match, as the history grows token by token."""

from __future__ import annotations

import numpy as np

from ppstate.spec_decode import _last_match
from ppstate.spec_probe import NgramProbe


class _Req:
    pass


def test_probe_equals_the_proposers_match_as_history_grows():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3):
        probe, req = NgramProbe(n), _Req()
        prompt = tuple(int(t) for t in rng.integers(0, 5, 6))
        outputs: list[int] = []
        for _ in range(40):
            h = np.array(prompt + tuple(outputs))
            want = h.size > n and _last_match(h, n) >= 0
            assert probe.has_proposal(req, prompt, outputs) == want, (n, h.tolist())
            outputs.append(int(rng.integers(0, 5)))
