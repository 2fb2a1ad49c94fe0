"""A draft-free step under ``--spec-tokens K`` applies its sampled ids to the token mirror the way
a spec-off step does (issue #33).

Under speculation the sampled payload is ``[R, K + 1]`` wide even when no row carried drafts
(every row samples one id, ``num == 1``). :meth:`TokenMirror.record` must then take the
one-id-per-row path (:meth:`TokenMirror._apply_one_at`, O(rows)), not the general ``[R, K + 1]``
scatter, and leave exactly the state the width-1 record leaves: the ids at column 0 written, the
padding columns ignored, the digests equal to a recomputation from the host ids.
"""

import numpy as np
import pytest
import torch

from runtime.worker.token_check import TokenMirror, position_weights

SLOTS = np.array([3, 0, 5], dtype=np.int64)
START = np.array([7, 2, 11], dtype=np.int64)
IDS = np.array([41, 17, 99], dtype=np.int64)


def _mirror() -> TokenMirror:
    m = TokenMirror(8, 16, torch.device("cpu"))
    for s in range(8):
        m.admit(s, list(range(100 + 16 * s, 100 + 16 * s + 12)))   # 12 prompt ids per slot
    return m


def _digest(ids_np: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return (ids_np.view(np.uint64) * position_weights(ids_np.shape[1])).sum(
            axis=1, dtype=np.uint64)


@pytest.mark.parametrize("k", [0, 2, 4])
def test_one_id_per_row_takes_the_plain_path_at_any_width(k, monkeypatch):
    m = _mirror()
    calls = []
    orig = m._apply_one_at
    monkeypatch.setattr(m, "_apply_one_at", lambda *a: (calls.append(a[0].tolist()), orig(*a)))
    sampled = np.full((3, k + 1), 7777, dtype=np.int64)   # padding columns: never written
    sampled[:, 0] = IDS
    m.record(torch.from_numpy(sampled), SLOTS, START, np.ones(3, dtype=np.int64))
    assert calls == [[41, 17, 99]]
    assert m.ids_np[SLOTS, START].tolist() == [41, 17, 99]
    assert int((m.ids_np == 7777).sum()) == 0
    assert np.array_equal(m.digest_np, _digest(m.ids_np))


@pytest.mark.parametrize("k", [2, 4])
def test_draft_free_step_leaves_the_state_of_a_spec_off_step(k):
    off, on = _mirror(), _mirror()
    off.record(torch.from_numpy(IDS.reshape(3, 1).copy()), SLOTS, START, np.ones(3, np.int64))
    wide = np.zeros((3, k + 1), dtype=np.int64)
    wide[:, 0] = IDS
    on.record(torch.from_numpy(wide), SLOTS, START, np.ones(3, dtype=np.int64))
    assert np.array_equal(on.ids_np, off.ids_np)
    assert np.array_equal(on.digest_np, off.digest_np)


def test_rows_with_several_ids_still_take_the_general_path(monkeypatch):
    m = _mirror()
    for one in ("_apply_one", "_apply_one_at"):
        monkeypatch.setattr(m, one, lambda *a: pytest.fail("one-id path for a 2-id row"))
    sampled = np.array([[41, 42, 0], [17, 0, 0], [99, 98, 97]], dtype=np.int64)
    m.record(torch.from_numpy(sampled), SLOTS, START, np.array([2, 1, 3], dtype=np.int64))
    assert m.ids_np[3, 7:9].tolist() == [41, 42]
    assert m.ids_np[0, 2:4].tolist() == [17, 100 + 3]      # position 3 keeps its prompt id
    assert m.ids_np[5, 11:14].tolist() == [99, 98, 97]
    assert np.array_equal(m.digest_np, _digest(m.ids_np))


def test_draft_free_step_allocates_no_drafts_tensor():
    """plan_rows on a step without drafts returns rows of the decoder's zeros (made once), not a
    fresh ``[R, K]`` tensor per step."""
    from types import SimpleNamespace

    from runtime.sampling.speculative_verify import SpecDecoder
    mirror = SimpleNamespace(num_computed_tokens_np=np.array([5, 9, 0, 0], dtype=np.int64),
                             num_computed_prefill_tokens_np=np.array([4, 6, 0, 0], np.int64),
                             prefill_len_np=np.array([4, 6, 0, 0], dtype=np.int64))
    state = SimpleNamespace(mirror=mirror, all_token_ids=torch.zeros(4, 32, dtype=torch.int64))
    out = SimpleNamespace(slots=np.array([1, 0], dtype=np.int32), step=3, num_rows=2,
                          num_scheduled_tokens=np.array([1, 1], dtype=np.int32))
    dec = SpecDecoder(4, 3, is_first=False, is_last=False)   # a middle rank: no writes
    assert dec.prepare(out, state).tolist() == [9, 5]
    first = dec.rows.drafts
    assert dec.prepare(out, state).tolist() == [9, 5]
    assert dec.rows.drafts.shape == (2, 4) and int(dec.rows.drafts.abs().sum()) == 0
    assert dec.rows.drafts.data_ptr() == first.data_ptr() == dec._zeros.data_ptr()
    assert dec._zeros.shape == (4, 4) and not dec.rows.any_drafts


def test_one_token_step_plans_no_draft_layout(monkeypatch):
    """A step of one-token rows on rank 0 / the last rank: starts from the rank's own counters
    (here ahead of nothing, behind an optimistic scheduler), no drafts, no decode mask, and no
    draft write at all (draft_scatter, the history scatter, the mirror record untouched)."""
    from types import SimpleNamespace

    from runtime.sampling import speculative_verify as sv
    mirror = SimpleNamespace(num_computed_tokens_np=np.array([5, 9, 0, 0], dtype=np.int64),
                             num_computed_prefill_tokens_np=np.array([4, 6, 0, 0], np.int64),
                             prefill_len_np=np.array([4, 6, 0, 0], dtype=np.int64))
    state = SimpleNamespace(mirror=mirror, all_token_ids=torch.zeros(4, 32, dtype=torch.int64),
                            tokens=SimpleNamespace(record=lambda *a: pytest.fail("record")))
    out = SimpleNamespace(slots=np.array([1, 0], dtype=np.int32), step=3, num_rows=2,
                          num_scheduled_tokens=np.array([1, 1], dtype=np.int32),
                          start_positions=np.array([10, 6], dtype=np.int32))   # optimistic
    monkeypatch.setattr(sv, "draft_scatter", lambda *a: pytest.fail("draft_scatter"))
    dec = sv.SpecDecoder(2, 3, is_first=True, is_last=True)
    assert dec.prepare(out, state).tolist() == [9, 5]
    rows = dec.rows
    assert (rows.any_drafts, rows.decode, rows.num_drafts.tolist()) == (False, None, [0, 0])
    assert int(state.all_token_ids.abs().sum()) == 0
    mirror.num_computed_tokens_np[1] = 12               # the rank's counters, not a stale copy
    assert dec.prepare(out, state).tolist() == [12, 5]
    assert mirror.num_computed_tokens_np[1] == 12 and rows.starts.tolist() == [9, 5]
