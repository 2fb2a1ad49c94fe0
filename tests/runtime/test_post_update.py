"""Post-update kernels: Triton (interpreter on CPU, compiled on CUDA) == torch fallback == a loop.

The reference below is a plain-Python restatement of the contract in
``runtime/worker/kernels/post_update.py``; every random case compares all state tensors exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ppstate.mirror import CpuMirror
from runtime.worker.kernels import post_update_computed, post_update_sampled, resolve_backend

REPO = Path(__file__).resolve().parents[2]
FIELDS = ("num_computed_tokens", "num_computed_prefill_tokens", "prefill_len", "total_len",
          "all_token_ids", "last_sampled_tokens")


def make_state(g: torch.Generator, m: int, length: int, width: int, dtype: torch.dtype,
               device: str = "cpu") -> dict[str, torch.Tensor]:
    """Random per-slot state: ``m`` slots, ``length`` = max_model_len, ids in [0, 1000)."""
    def r(lo, hi, *shape):
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64)
    prefill_len = r(1, 40, m)
    st = {"num_computed_tokens": r(0, 60, m), "prefill_len": prefill_len,
          "num_computed_prefill_tokens": torch.minimum(r(0, 45, m), prefill_len),
          "total_len": r(0, length + 1, m), "all_token_ids": r(0, 1000, m, length),
          "last_sampled_tokens": r(0, 1000, m, width)}
    return {k: v.to(device=device, dtype=torch.int64 if k == "last_sampled_tokens" else dtype)
            for k, v in st.items()}


def make_batch(g: torch.Generator, m: int, width: int, device: str = "cpu"):
    """Random batch: distinct slots, some rows -1, num_sampled in [0, width], rejected < sampled."""
    rows = int(torch.randint(0, m + 1, (1,), generator=g))
    idx = torch.randperm(m, generator=g)[:rows]
    idx[torch.rand(rows, generator=g) < 0.3] = -1
    q = torch.randint(1, 50, (rows,), generator=g)
    ns = torch.randint(0, width + 1, (rows,), generator=g)
    nr = (torch.rand(rows, generator=g) * ns).long()  # 0 <= rejected < max(ns, 1)
    ids = torch.randint(0, 1000, (rows, width), generator=g)
    return {"idx_mapping": idx.to(device, torch.int32), "num_scheduled_tokens": q.to(device, torch.int32),
            "sampled_token_ids": ids.to(device), "num_sampled": ns.to(device, torch.int32),
            "num_rejected": nr.to(device, torch.int32)}


def reference(st: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, list]:
    """Plain-Python loop over rows: computed phase, then sampled phase."""
    s = {k: v.tolist() for k, v in st.items()}
    length = st["all_token_ids"].shape[1]
    for r, slot in enumerate(b["idx_mapping"].tolist()):
        if slot < 0:
            continue
        q = int(b["num_scheduled_tokens"][r])
        s["num_computed_tokens"][slot] += q
        rem = max(s["prefill_len"][slot] - s["num_computed_prefill_tokens"][slot], 0)
        s["num_computed_prefill_tokens"][slot] += min(q, rem)
    for r, slot in enumerate(b["idx_mapping"].tolist()):
        if slot < 0:
            continue
        s["num_computed_tokens"][slot] -= int(b["num_rejected"][r])
        n = int(b["num_sampled"][r])
        if n == 0:
            continue
        ids = b["sampled_token_ids"][r].tolist()
        for i in range(n):
            if s["total_len"][slot] + i < length:
                s["all_token_ids"][slot][s["total_len"][slot] + i] = ids[i]
        s["total_len"][slot] = min(s["total_len"][slot] + n, length)
        s["last_sampled_tokens"][slot] = ids
    return s


def run(st: dict[str, torch.Tensor], b: dict[str, torch.Tensor], backend: str) -> dict[str, list]:
    st = {k: v.clone() for k, v in st.items()}
    post_update_computed(b["idx_mapping"], b["num_scheduled_tokens"], st["num_computed_tokens"],
                         st["num_computed_prefill_tokens"], st["prefill_len"], backend=backend)
    post_update_sampled(b["idx_mapping"], b["sampled_token_ids"], b["num_sampled"],
                        b["num_rejected"], st["last_sampled_tokens"], st["all_token_ids"],
                        st["total_len"], st["num_computed_tokens"], backend=backend)
    return {k: v.cpu().tolist() for k, v in st.items()}


@pytest.mark.parametrize("width,dtype", [(1, torch.int32), (1, torch.int64), (4, torch.int32)])
def test_random_batches_triton_interpreter_torch_and_loop_agree(width, dtype):
    g = torch.Generator().manual_seed(1234 + width)
    for _ in range(25):
        st = make_state(g, m=8, length=24, width=width, dtype=dtype)
        b = make_batch(g, 8, width)
        ref = reference(st, b)
        assert run(st, b, "torch") == ref
        assert run(st, b, "triton") == ref
        # -1 rows and unscheduled slots are untouched, field by field
        hit = set(b["idx_mapping"][b["idx_mapping"] >= 0].tolist())
        for slot in set(range(8)) - hit:
            for k in FIELDS:
                assert ref[k][slot] == st[k][slot].tolist()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_minus_one_never_touches_last_slot(backend):
    """A -1 row must not index slot max_num_reqs-1 through negative indexing."""
    st = {"num_computed_tokens": torch.tensor([5, 6, 7, 8]), "prefill_len": torch.tensor([9, 9, 9, 9]),
          "num_computed_prefill_tokens": torch.tensor([1, 2, 3, 4]),
          "total_len": torch.tensor([1, 1, 1, 1]), "all_token_ids": torch.zeros(4, 3, dtype=torch.int64),
          "last_sampled_tokens": torch.tensor([[70], [71], [72], [73]])}
    b = {"idx_mapping": torch.tensor([-1, 0, -1], dtype=torch.int32),
         "num_scheduled_tokens": torch.tensor([3, 2, 3], dtype=torch.int32),
         "sampled_token_ids": torch.tensor([[100], [101], [102]]),
         "num_sampled": torch.tensor([1, 1, 1], dtype=torch.int32),
         "num_rejected": torch.tensor([1, 0, 1], dtype=torch.int32)}
    out = run(st, b, backend)
    assert out["num_computed_tokens"] == [7, 6, 7, 8]
    assert out["num_computed_prefill_tokens"] == [3, 2, 3, 4]
    assert out["total_len"] == [2, 1, 1, 1]
    assert out["all_token_ids"] == [[0, 101, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert out["last_sampled_tokens"] == [[101], [71], [72], [73]]
    b["idx_mapping"] = torch.tensor([-1, -1, -1], dtype=torch.int32)
    assert run(st, b, backend) == {k: v.tolist() for k, v in st.items()}


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_writes_bounded_by_max_model_len(backend):
    st = {"num_computed_tokens": torch.tensor([10]), "prefill_len": torch.tensor([4]),
          "num_computed_prefill_tokens": torch.tensor([4]), "total_len": torch.tensor([5]),
          "all_token_ids": torch.arange(6).view(1, 6), "last_sampled_tokens": torch.zeros(1, 3, dtype=torch.int64)}
    b = {"idx_mapping": torch.tensor([0], dtype=torch.int32), "num_scheduled_tokens": torch.tensor([3], dtype=torch.int32),
         "sampled_token_ids": torch.tensor([[40, 41, 42]]), "num_sampled": torch.tensor([3], dtype=torch.int32),
         "num_rejected": torch.tensor([2], dtype=torch.int32)}
    out = run(st, b, backend)
    assert out["all_token_ids"] == [[0, 1, 2, 3, 4, 40]]
    assert out["total_len"] == [6]
    assert out["last_sampled_tokens"] == [[40, 41, 42]]
    assert out["num_computed_tokens"] == [11]
    assert out["num_computed_prefill_tokens"] == [4]


def test_device_update_matches_cpu_mirror():
    """The kernels' count arithmetic is the CpuMirror's (invariant 4)."""
    g = torch.Generator().manual_seed(7)
    for _ in range(20):
        st = make_state(g, m=8, length=24, width=1, dtype=torch.int64)
        b = make_batch(g, 8, 1)
        mirror = CpuMirror(8)
        for f in ("num_computed_tokens", "prefill_len", "num_computed_prefill_tokens"):
            mirror.array(f)[:] = st[f].numpy()
        slots = b["idx_mapping"].numpy().astype(np.int64)
        mirror.apply_scheduled(slots, b["num_scheduled_tokens"].numpy())
        mirror.apply_rejected(slots, b["num_rejected"].numpy())
        out = run(st, b, "torch")
        mirror.validate({f: out[f] for f in ("num_computed_tokens", "num_computed_prefill_tokens")},
                        np.arange(8), step=0)


def test_argument_errors():
    z = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="width 2 != last_sampled_tokens width 1"):
        post_update_sampled(torch.zeros(1, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int64),
                            z[:1], z[:1], torch.zeros(4, 1, dtype=torch.int64),
                            torch.zeros(4, 8, dtype=torch.int64), z, z.clone())
    with pytest.raises(ValueError, match="num_scheduled_tokens has 2 rows, expected 1"):
        post_update_computed(torch.zeros(1, dtype=torch.int32), z[:2], z, z.clone(), z.clone())
    with pytest.raises(ValueError, match="backend must be one of"):
        post_update_computed(torch.zeros(1, dtype=torch.int32), z[:1], z, z.clone(), z.clone(),
                             backend="cuda")
    assert resolve_backend("torch", torch.device("cpu")) == "torch"


def test_auto_backend_follows_env_in_fresh_process():
    """auto -> torch on CPU; PPSTATE_TRITON_INTERPRET=1 -> Triton (interpreter), same results."""
    code = ("import torch; from runtime.worker.kernels import resolve_backend as r; "
            "print(r('auto', torch.device('cpu')))")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PPSTATE_TRITON_INTERPRET")}
    outs = []
    for extra in ({}, {"PPSTATE_TRITON_INTERPRET": "1"}, {"TRITON_INTERPRET": "1"}):
        p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**env, **extra},
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        outs.append(p.stdout.strip())
    assert outs == ["torch", "triton", "triton"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("width", [1, 4])
def test_compiled_triton_on_cuda_matches_loop(width):
    g = torch.Generator().manual_seed(99 + width)
    for _ in range(50):
        st = make_state(g, m=64, length=32, width=width, dtype=torch.int32)
        b = make_batch(g, 64, width)
        ref = reference(st, b)
        gst = {k: v.cuda() for k, v in st.items()}
        gb = {k: v.cuda() for k, v in b.items()}
        assert resolve_backend("auto", gb["idx_mapping"].device) == "triton"
        assert run(gst, gb, "auto") == ref
        assert run(gst, gb, "torch") == ref
