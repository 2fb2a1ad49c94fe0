"""``--explain REQ_ID``: one request's life read from a trace, in order: arrival, admission (slot
and its generation), each step it was scheduled in, each lifecycle edge, each token delivered,
each deferred consume of its rows on earlier ranks, and its end.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from ppstate.trace.run import TraceRun


def request_ids(run: TraceRun) -> list[str]:
    """The ids of the requests that arrived in ``run``, in arrival order: the valid
    ``--explain`` values."""
    return [ev["req_id"] for ev in run.engine if ev.get("kind") == "arrival"]


def explain(run: TraceRun, req_id: str) -> list[dict[str, Any]]:
    """The life of ``req_id`` as ``{step, rank, what, ...}`` entries, in recorded order (engine
    events first within a step, then rank events). Empty when the id never arrived."""
    life: list[dict[str, Any]] = []
    generation: dict[int, int] = defaultdict(int)   # slot -> generation (frees so far)
    rows: dict[int, int] = {}                       # step -> this request's row
    for ev in run.engine:
        kind, step = ev.get("kind"), ev.get("step", -1)
        if kind == "arrival" and ev["req_id"] == req_id:
            life.append({"step": step, "rank": None, "what": "arrival",
                         "prompt_len": ev["prompt_len"], "max_tokens": ev["max_tokens"],
                         "sampling": ev.get("sampling", {})})
        elif kind in ("abort", "stop") and ev["req_id"] == req_id:
            life.append({"step": step, "rank": None, "what": kind})
        elif kind == "lifecycle" and ev["req_id"] == req_id:
            life.append({"step": step, "rank": None, "what": "lifecycle",
                         "trigger": ev["trigger"], "state": ev["state"]})
        elif kind == "schedule":
            life += _scheduled(ev["output"], req_id, generation, rows)
        elif kind == "tokens":
            for u in ev["updates"]:
                if u["req_id"] == req_id:
                    life.append({"step": step, "rank": None, "what": "tokens",
                                 "of_step": ev["of_step"], "token_ids": u["token_ids"],
                                 "finish_reason": u["finish_reason"]})
    depth = run.header.pp_size  # pp.consume exists in overlapped mode only: depth = pp_size
    for rank, events in sorted(run.ranks.items()):
        for ev in events:
            if ev.get("kind") == "pp.consume" and ev["step"] in rows:
                slot = ev["idx_mapping"][rows[ev["step"]]]
                life.append({"step": ev["step"] + depth, "rank": rank, "what": "deferred consume",
                             "of_step": ev["step"], "slot": slot, "applied": slot >= 0})
    return sorted(life, key=lambda e: (e["step"], -1 if e["rank"] is None else e["rank"]))


def _scheduled(out: dict, req_id: str, generation: dict[int, int],
               rows: dict[int, int]) -> list[dict[str, Any]]:
    step, found = out["step"], []
    for f in out.get("freed", []):
        if f["req_id"] == req_id:
            found.append({"step": step, "rank": None, "what": "slot freed", "slot": f["slot"],
                          "reason": f["reason"]})
        generation[f["slot"]] += 1
    for n in out.get("new_requests", []):
        if n["req_id"] == req_id:
            found.append({"step": step, "rank": None, "what": "admitted", "slot": n["slot"],
                          "generation": generation[n["slot"]], "max_seq_len": n["max_seq_len"]})
    for i, rid in enumerate(out["req_ids"]):
        if rid == req_id:
            rows[step] = i
            found.append({"step": step, "rank": None, "what": "scheduled", "row": i,
                          "slot": out["slots"][i], "start": out["start_positions"][i],
                          "num_scheduled_tokens": out["num_scheduled_tokens"][i],
                          "final_chunk": out["is_final_chunk"][i]})
    return found


def format_life(req_id: str, life: list[dict[str, Any]]) -> str:
    """Human-readable lines of :func:`explain`'s entries."""
    if not life:
        return f"{req_id}: not in this trace"
    lines = [f"life of {req_id}:"]
    for e in life:
        where = f"step {e['step']:>5}" + ("" if e["rank"] is None else f" rank {e['rank']}")
        rest = {k: v for k, v in e.items() if k not in ("step", "rank", "what")}
        lines.append(f"  {where:<18} {e['what']:<16} " +
                     " ".join(f"{k}={v}" for k, v in rest.items()))
    return "\n".join(lines)
