"""Engine flags shared by ``runtime.serve``, ``runtime.generate`` and ``runtime.bench``."""

from __future__ import annotations

import argparse

from pydantic import ValidationError

from runtime.config import EngineConfig
from runtime.torchrun import resolve_cli

#: flag -> EngineConfig field
ENGINE_FLAGS = {
    "--model": "model", "--pp": "pp_size", "--pp-layer-partition": "pp_layer_partition",
    "--pp-schedule": "pp_schedule", "--max-num-seqs": "max_num_seqs",
    "--max-model-len": "max_model_len", "--max-num-batched-tokens": "max_num_batched_tokens",
    "--max-prefill-chunk": "max_prefill_chunk", "--validate-mirrors": "validate_mirrors",
    "--device": "device", "--dtype": "dtype", "--torch-threads": "torch_threads",
    "--step-timeout": "step_timeout_s", "--heartbeat-timeout": "heartbeat_timeout_s",
    "--trace-dir": "trace_dir",
    "--trace-prompts": "trace_prompts",
    "--served-model-name": "served_model_name", "--launcher": "launcher",
    "--engine-port": "engine_port", "--block-size": "block_size",
    "--kv-cache-memory": "kv_cache_memory", "--enable-prefix-caching": "enable_prefix_caching",
    "--enforce-eager": "enforce_eager",
    "--dp": "dp_size", "--spec-tokens": "spec_tokens", "--spec-ngram": "spec_ngram",  # issue #14
}


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Add the engine flags (defaults come from :class:`EngineConfig`)."""
    d = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=d.model, help="'default' (embedded SmolLM2-135M-Instruct "
                   "GGUF), a .gguf file or a Hugging Face folder")
    g.add_argument("--pp", type=int, default=None, help="pipeline stages (worker processes); "
                   f"default {d.pp_size}, or WORLD_SIZE under torchrun")
    g.add_argument("--pp-layer-partition", default=None, help="layers per stage, e.g. 19,11")
    g.add_argument("--pp-schedule", choices=["overlapped", "sync"], default=d.pp_schedule)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-model-len", type=int, default=d.max_model_len)
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument("--max-prefill-chunk", type=int, default=d.max_prefill_chunk)
    g.add_argument("--validate-mirrors", default=d.validate_mirrors, help="every | N | off")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default=d.device)
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=d.dtype)
    g.add_argument("--torch-threads", type=int, default=d.torch_threads)
    g.add_argument("--step-timeout", type=float, default=d.step_timeout_s,
                   help="seconds any receive, collective or step may take (then the engine fails)")
    g.add_argument("--heartbeat-timeout", type=float, default=d.heartbeat_timeout_s,
                   help="seconds a rank may be silent (killed, frozen) before the engine fails")
    g.add_argument("--trace-dir", default=None, help="record the run in a new run-* directory "
                   "here (header + one JSONL event file per process; replay with "
                   "python -m ppstate.replay DIR)")
    g.add_argument("--trace-prompts", action="store_true", help="with --trace-dir: also record "
                   "prompt token ids (default: prompt lengths only)")
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--launcher", choices=["auto", "spawn", "torchrun"], default="auto",
                   help="spawn: one process per rank on this machine; torchrun: the ranks are "
                   "torchrun's processes (auto: torchrun when RANK, WORLD_SIZE, ... are set)")
    g.add_argument("--engine-port", type=int, default=d.engine_port, help="torchrun: the engine's "
                   "TCP ports on the rank-0 host are PORT .. PORT + pp (see docs/torchrun.md)")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV-cache block")
    g.add_argument("--kv-cache-memory", default=None, help="KV cache per rank: bytes with an "
                   "optional KB/MB/GB suffix (e.g. 24MB), or a fraction of the free device memory "
                   "after loading weights (CUDA, e.g. 0.9); default: max_model_len tokens per slot")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d.enable_prefix_caching, help="reuse KV blocks of shared prompt prefixes")
    g.add_argument("--enforce-eager", action="store_true", default=d.enforce_eager,
                   help="CUDA: no CUDA graphs (decode steps run eagerly); capture time and memory "
                   "are printed at startup otherwise")
    # ---- data parallelism (issue #14) ----
    g.add_argument("--dp", type=int, default=d.dp_size, help="data-parallel replicas: independent "
                   "pipelines of --pp ranks each behind one server (least-loaded routing); "
                   "dp x pp rank processes")
    g.add_argument("--spec-tokens", type=int, default=d.spec_tokens, help="n-gram speculative "
                   "decoding: draft tokens per decode row (0: off)")
    g.add_argument("--spec-ngram", type=int, default=d.spec_ngram, help="n-gram length the "
                   "speculative proposer matches against the request's earlier tokens")


def engine_config(p: argparse.ArgumentParser, args: argparse.Namespace) -> EngineConfig:
    """Build the EngineConfig; a bad value exits via ``p.error`` naming the flag."""
    values = {field: getattr(args, flag[2:].replace("-", "_")) for flag, field in ENGINE_FLAGS.items()}
    try:
        values = resolve_cli(values)
    except ValueError as exc:
        p.error(str(exc))
    args.pp = values["pp_size"]  # callers (bench) read args.pp
    if values.get("dp_size", 1) > 1 and values["launcher"] == "torchrun":  # issue #14
        p.error("--dp: data parallelism needs the spawn launcher; under torchrun run one server "
                "per pipeline")
    try:
        return EngineConfig(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = err["loc"][0] if err["loc"] else None
        flag = next((f for f, fld in ENGINE_FLAGS.items() if fld == field), None)
        p.error(f"{flag or 'engine config'}: {err['msg']}")
        raise  # unreachable: p.error exits
