"""Entry point of one worker process (one rank: a PP rank, or one TP rank of a stage, docs/tp.md).

Loads only this rank's layers, sets up torch.distributed (PP group + sibling broadcast group),
then serves step messages from the engine until told to stop, or until the engine is gone (the
parent process changed, or, under torchrun, no message for ``args.idle_exit_s`` seconds although
the engine pings every second). Any exception is reported to the engine as an error message (rank,
step, type, message, traceback) before the process exits.
"""

from __future__ import annotations

import os
import sys
import time
from functools import partial

import torch
import zmq

from ppstate.events import NULL_SINK, JsonlSink
from ppstate.trace.run import HEADER, new_run_dir
from runtime import transport as tp
from runtime.config import EngineConfig
from runtime.device import uses_cuda
from runtime.model.stage import load_stage
from runtime.worker.device_state import DeviceState
from runtime.worker.groups import destroy_groups, init_groups
from runtime.worker.heartbeat import Heartbeat
from runtime.worker.kv_capacity import rank_num_blocks
from runtime.worker.progress import Progress
from runtime.worker.runner import StageRunner


def pick_device(cfg: EngineConfig, rank: int) -> torch.device:
    """``cuda:<i % n>`` when CUDA is asked for (or auto and available), else CPU; ``i`` is the
    rank, or ``LOCAL_RANK`` (the rank on this machine) under the torchrun launcher."""
    if uses_cuda(cfg.device):
        if cfg.launcher == "torchrun" and "LOCAL_RANK" in os.environ:
            rank = int(os.environ["LOCAL_RANK"])
        return torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def pick_dtype(cfg: EngineConfig, device: torch.device) -> torch.dtype:
    """fp32 on CPU, bf16 on CUDA for ``auto``; otherwise as configured."""
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def rank_trace_path(trace_dir: str, rank: int) -> str:
    """``rank<N>.jsonl`` in the engine's run directory; a rank started by torchrun on another
    host (no header there) opens its own run directory under ``trace_dir`` instead."""
    run_dir = trace_dir if os.path.isfile(os.path.join(trace_dir, HEADER)) else new_run_dir(trace_dir)
    return os.path.join(run_dir, f"rank{rank}.jsonl")


class _Worker:
    def __init__(self, args, push: zmq.Socket) -> None:
        self.args, self.push = args, push
        self.cfg = EngineConfig(**args.config)
        self.rank = args.rank
        self.step = -1
        self._held = None    # (PendingResult, busy_s) of a launched step not answered yet

    def setup(self) -> None:
        cfg = self.cfg
        torch.set_num_threads(cfg.torch_threads)
        device = pick_device(cfg, self.rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if cfg.tp_size > 1:   # global rank pp_rank * tp + tp_rank (docs/tp.md)
            from runtime.worker.tp_groups import init_tp_groups
            self.groups = init_tp_groups(self.rank, cfg.scheduler.pp_size, cfg.tp_size,
                                         self.args.init_method, device, cfg.step_timeout_s)
        else:
            self.groups = init_groups(self.rank, cfg.scheduler.pp_size, self.args.init_method,
                                      device, cfg.step_timeout_s)
        self.tp_comm = tp_comm(self.groups)   # None without TP
        dtype = pick_dtype(cfg, device)
        stage = self._load_stage(cfg, device, dtype)
        start, end = self.args.layer_range
        self.num_kv_blocks = rank_num_blocks(cfg, stage.cfg, end - start, dtype, device)
        stage.allocate_kv_cache(self.num_kv_blocks)
        k = cfg.scheduler.num_spec_tokens
        state = DeviceState(cfg.scheduler.max_num_seqs, cfg.scheduler.max_model_len, 1 + k, device,
                            self.groups.rank, cfg.scheduler.block_size)   # PP rank
        sink = NULL_SINK
        if cfg.trace_dir and self.groups.tp_rank == 0:   # TP rank 0 traces for its stage
            sink = JsonlSink(rank_trace_path(cfg.trace_dir, self.groups.rank),
                             trace_prompts=cfg.trace_prompts)
        # Hold a launched step's result while launching the next only where launching does not
        # block the host on a peer (PP=1, or NCCL's stream-ordered receives).
        self._may_hold = cfg.scheduler.pp_size == 1 or self.groups.nccl
        fast, graphs = self._fast_path(stage, cfg, device)
        spec = verify_graphs = None
        if k > 0:  # speculative decoding (#14; on the CUDA fast path #33)
            from runtime.sampling.speculative_verify import SpecDecoder
            spec = SpecDecoder(k, cfg.spec_ngram, self.groups.is_first, self.groups.is_last)
            if graphs is not None and not getattr(graphs, "piecewise", False):
                verify_graphs = self._verify_graphs(fast, cfg, k)
        grammar = None
        if self.groups.is_last:   # structured outputs: built on the first constrained request
            from runtime.worker.grammar_hooks import GrammarHooks
            grammar = GrammarHooks(partial(grammar_state, self.args.model_path,
                                           stage.cfg.vocab_size, cfg.scheduler.max_num_seqs))
        self.runner = StageRunner(self.groups, stage, state, cfg.scheduler.mode == "overlapped",
                                  cfg.validate_every, sink, fast=fast, graphs=graphs,
                                  progress=self.progress, spec=spec, grammar=grammar,
                                  verify_graphs=verify_graphs,
                                  check_kernel=cfg.mirror_check_kernel)
        self.sink = sink

    def _load_stage(self, cfg: EngineConfig, device: torch.device, dtype: torch.dtype):
        """The rank's layers: the CPU fast path (quantized weights, this rank's share of the
        cores; ``docs/cpu_fast_path.md``) or the reference ``StageModel``."""
        common = dict(max_num_reqs=cfg.scheduler.max_num_seqs, progress=(self.rank == 0),
                      max_model_len=cfg.scheduler.max_model_len,
                      block_size=cfg.scheduler.block_size, num_blocks=1)
        fast_cpu = device.type == "cpu" and self._cpu_fast_path(cfg)
        if self.tp_comm is not None:   # tensor parallelism: this TP rank's slice (exact path)
            from runtime.model.tp.stage import load_tp_stage
            return load_tp_stage(self.args.model_path, self.args.layer_range, self.tp_comm,
                                 dtype=dtype, device=device, batch_invariant=True, **common)
        if fast_cpu:
            from runtime.model.cpu.fast_stage import load_fast_stage
            from runtime.model.cpu.threads import apply_threads, plan_threads
            pin = cfg.cpu_pin and cfg.launcher == "spawn" and cfg.dp_size == 1
            threads, cores = plan_threads(cfg.cpu_threads, cfg.scheduler.pp_size, self.rank, pin=pin)
            apply_threads(threads, cores)
            return load_fast_stage(self.args.model_path, self.args.layer_range, **common)
        return load_stage(self.args.model_path, self.args.layer_range, dtype=dtype,
                          device=device, batch_invariant=True, **common)

    def _cpu_fast_path(self, cfg: EngineConfig) -> bool:
        """Whether this CPU rank serves with the fast path; rank 0 prints which path serves and
        why the fast one is bypassed (``runtime/model/cpu/path_choice.py``). The choice is the
        same on all ranks: it depends on the configuration and the model only."""
        from runtime.model.cpu.path_choice import cpu_path_line, exact_reasons
        reasons = exact_reasons(cfg.cpu_path, cfg.tp_size, cfg.scheduler.num_spec_tokens,
                                self._model_unsupported)
        if self.rank == 0:
            print(cpu_path_line(reasons), file=sys.stderr, flush=True)
        return not reasons

    def _model_unsupported(self) -> str | None:
        """What of this model the CPU fast path does not implement, or None."""
        from runtime.model.cpu.fast_stage import fast_path_unsupported
        from runtime.model.registry import resolve_model_path
        from runtime.model.weights import open_checkpoint
        return fast_path_unsupported(open_checkpoint(resolve_model_path(self.args.model_path)).config)

    def _fast_path(self, stage, cfg: EngineConfig, device: torch.device):
        """CUDA: the Triton fast path over the stage's cache, and (unless ``--enforce-eager``)
        decode-only CUDA graphs captured now, with their time and memory printed (rank 0 shows
        a progress bar). CPU: (None, None), the exact reference path."""
        self.graph_report = None
        if device.type != "cuda" or cfg.cuda_path == "reference":
            return None, None
        from runtime.worker.tp_graphs import fast_path_classes   # TP: docs/tp.md
        stage_cls, graphs_cls = fast_path_classes(self.tp_comm, self.groups.nccl)
        fast = stage_cls(stage)
        if cfg.enforce_eager:
            return fast, None
        graphs = graphs_cls(fast, cfg.scheduler.max_num_seqs, -(-cfg.scheduler.max_model_len // cfg.scheduler.block_size),
                              cfg.scheduler.max_model_len)
        rep = graphs.capture(progress=(self.rank == 0))
        self.graph_report = {"buckets": len(rep.buckets), "seconds": round(rep.seconds, 2),
                             "bytes": rep.bytes,
                             "graphs_per_step": getattr(graphs, "num_segments", {}).get(
                                 rep.buckets[-1], 1)}   # > 1: piecewise (TP over gloo)
        print(f"rank {self.rank}: captured {len(rep.buckets)} CUDA graphs (decode batches "
              f"{rep.buckets[0]}..{rep.buckets[-1]}) in {rep.seconds:.1f} s, "
              f"{rep.bytes / 2**20:.0f} MiB", file=sys.stderr, flush=True)
        return fast, graphs

    def _verify_graphs(self, fast, cfg: EngineConfig, k: int):
        """CUDA graphs of speculative verify steps (every row ``1 + K`` tokens, padded), captured
        now after the decode graphs (``runtime/worker/verify_graphs.py``)."""
        from runtime.worker.verify_graphs import VerifyGraphs
        s = cfg.scheduler
        vg = VerifyGraphs(fast, s.max_num_seqs, -(-s.max_model_len // s.block_size),
                          s.max_model_len, k)
        rep = vg.capture(progress=(self.rank == 0))
        self.graph_report = dict(self.graph_report or {}, verify_buckets=len(rep.buckets),
                                 verify_seconds=round(rep.seconds, 2), verify_bytes=rep.bytes)
        print(f"rank {self.rank}: captured {len(rep.buckets)} verify CUDA graphs (K = {k}) in "
              f"{rep.seconds:.1f} s, {rep.bytes / 2**20:.0f} MiB", file=sys.stderr, flush=True)
        return vg

    def serve(self, pull: zmq.Socket) -> None:
        """Handle engine messages until shutdown, parent death or ``idle_exit_s`` of silence."""
        parent = os.getppid()
        idle_s = getattr(self.args, "idle_exit_s", None)
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        last = time.monotonic()
        while True:
            if not poller.poll(1000 if idle_s is None else int(min(1.0, idle_s) * 1000)):
                if os.getppid() != parent:
                    return  # the engine is gone
                if idle_s is not None and time.monotonic() - last > idle_s:
                    return  # torchrun: the engine stopped pinging
                continue
            last = time.monotonic()
            msg = tp.decode(pull.recv())
            if msg.kind != "step":
                self._flush()
            if msg.kind == "shutdown":
                return
            if msg.kind == "corrupt_state":
                self.runner.state.corrupt(msg.slot, msg.field, msg.delta)
                continue
            if msg.kind == "warm_grammar":
                if self.runner.grammar is not None:
                    self.runner.grammar.warm()
                continue
            if msg.kind == "step":
                self._step(msg)
                if not pull.poll(0):    # no next step queued: send this one's result now
                    self._flush()
                self.runner.run_deferred_check()   # the mirror check, after the result left

    def _step(self, msg) -> None:
        """Launch one step. The last rank holds its result back until the next step (when one
        is already queued) has been launched too, so preparing step N+1's inputs overlaps the
        GPU work of step N; results still leave in step order."""
        out = tp.to_scheduler_output(msg)
        self.step = out.step
        self.progress.begin_step(out.step, decode_only=bool(
            out.num_rows and (out.num_scheduled_tokens == 1).all()))
        pending = self.runner.launch(out)
        if self.tp_comm is not None and self.cfg.validate_every \
                and out.step % self.cfg.validate_every == 0:   # TP ranks agree on token ids
            from runtime.worker.tp_check import check_tp_agreement
            st = self.runner.state
            check_tp_agreement(self.tp_comm, st.all_token_ids, st.total_len, out.step,
                               self.groups.rank)
        busy = self.runner.timing.busy_s
        self._flush()                   # the previous step's result: its kernels ran first
        if pending is not None:
            self._held = (pending, busy)
            if pending.ready() or not self._may_hold:
                self._flush()           # CPU (already complete) or host-blocking receives
        else:
            h = self.runner.handler
            self.push.send(tp.encode(tp.ResultMsg.timing_only(
                out.step, self.rank, busy, 0 if h is None else h.num_dropped)))
        self.progress.end_step()

    def _flush(self) -> None:
        """Send the held result, waiting for its sampled ids to reach the host if needed."""
        if self._held is None:
            return
        pending, busy = self._held
        self._held = None
        self.push.send(tp.encode(tp.from_step_result(pending.result(), rank=self.rank,
                                                     busy_s=busy)))

    def report(self, exc: BaseException) -> None:
        msg = tp.ErrorMsg.from_exception(self.rank, self.step, exc)
        g = getattr(self, "groups", None)
        if g is not None and g.tp_size > 1:   # name the stage and the TP rank
            msg.message = f"pp rank {g.rank}, tp rank {g.tp_rank}: {msg.message}"
        self.push.send(tp.encode(msg))


def tp_comm(groups):
    """The :class:`~runtime.model.tp.comm.TPComm` of this rank's stage, its generators seeded
    like TP rank 0's; None without tensor parallelism."""
    if groups.tp_size == 1:
        return None
    from runtime.model.tp.comm import TPComm
    comm = TPComm(groups.tp_group, groups.tp_size, groups.tp_rank, groups.stage_on_host,
                  groups.comm_device())
    comm.broadcast_seed()
    return comm


def grammar_state(model_path: str, vocab_size: int, max_num_reqs: int):
    """The last rank's :class:`~runtime.sampling.grammar_state.GrammarState` for the model's
    tokenizer (``vocab_size``: the logit width)."""
    from runtime.model.tokenizer import load_tokenizer
    from runtime.sampling.grammar import GrammarCompilerCache, tokenizer_info
    from runtime.sampling.grammar_state import GrammarState
    tok = load_tokenizer(model_path)
    return GrammarState(GrammarCompilerCache(tokenizer_info(tok, vocab_size), str(model_path)),
                        max_num_reqs)


def report_error(result_addr: str, rank: int, exc: BaseException, linger_ms: int = 5000) -> None:
    """Send one ErrorMsg (step -1) to the engine at ``result_addr`` and return, waiting at most
    ``linger_ms`` ms for delivery; for failures before :func:`run_worker` could start."""
    ctx = zmq.Context()
    push = tp.make_push(ctx, result_addr, bind=False, linger_ms=linger_ms)
    push.send(tp.encode(tp.ErrorMsg.from_exception(rank, -1, exc)))
    push.close()
    ctx.term()


def run_worker(args) -> int:
    """Process body: connect to the engine, set up the rank, serve steps, report failures.

    Returns:
        0 after a shutdown message or a vanished engine, 1 after an error (reported to the engine
        as an ErrorMsg; never raised).
    """
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(args.result_addr)
    pull = ctx.socket(zmq.PULL)
    pull.connect(args.step_addr)
    w = _Worker(args, push)
    w.progress = Progress(args.rank)  # step / phase, read by the heartbeat (and the stall hook)
    w.heartbeat = Heartbeat(ctx, args.result_addr, args.rank, progress=w.progress).start()
    status = 0
    try:
        w.setup()
        push.send(tp.encode(tp.ReadyMsg(rank=args.rank, info={"layers": list(args.layer_range),
                                                              "num_kv_blocks": w.num_kv_blocks,
                                                              "cuda_graphs": w.graph_report})))
        w.serve(pull)
    except BaseException as exc:  # noqa: BLE001 - report everything to the engine
        w.report(exc)
        status = 1
    finally:
        w.heartbeat.stop()
        if getattr(w, "sink", None) is not None:
            w.sink.close()
        if getattr(w, "groups", None) is not None:
            try:
                destroy_groups(w.groups)
            except Exception:  # noqa: BLE001 - peers may be gone already
                pass
        pull.close(0)
        push.close()
        ctx.term()
    return status
