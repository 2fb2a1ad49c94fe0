"""The engine flags of ``runtime.serve``, ``runtime.generate`` and ``runtime.bench``, from ONE table.

:data:`ENGINE_FLAGS` names each flag and the :class:`~runtime.config.EngineConfig` field it sets
(``scheduler.*`` for the fields of the contained :class:`~ppstate.budget.SchedulerConfig`). The
flag's type, choices and default come from that field (its annotation and ``EngineConfig()``),
its help from the field's ``description`` or, for scheduler fields, from the table. The argparse
flags (:func:`add_engine_flags`) and the docs table (:func:`markdown_table`, in docs/config.md;
``python -m runtime.cli_common --write-docs`` rewrites it, tests/runtime/test_cli_flags.py fails on
drift) are both generated from it.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from ppstate.budget import SchedulerConfig
from runtime.config import EngineConfig
from runtime.engine.torchrun import resolve_cli


@dataclass(frozen=True)
class Flag:
    """One engine flag.

    Attributes:
        name: the flag, e.g. ``--max-num-seqs``.
        field: the EngineConfig field it sets: ``model`` or ``scheduler.max_num_seqs``.
        help: help text; empty: the field's pydantic ``description``.
        cli_default: the flag's own default where it is resolved later (``--pp``, ``--launcher``).
        extra_choices: choices the flag has beyond the field's (``auto`` of ``--launcher``).
    """
    name: str
    field: str
    help: str = ""
    cli_default: Any = ...
    extra_choices: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        """The argparse attribute: ``--max-num-seqs`` -> ``max_num_seqs``."""
        return self.name[2:].replace("-", "_")

    @property
    def key(self) -> str:
        """The field's own name (the last part of :attr:`field`)."""
        return self.field.rpartition(".")[2]

    @property
    def annotation(self) -> Any:
        """The field's type (``X | None`` unwrapped)."""
        if self.field.startswith("scheduler."):
            ann = typing.get_type_hints(SchedulerConfig)[self.key]
        else:
            ann = EngineConfig.model_fields[self.field].annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        is_union = typing.get_origin(ann) in (typing.Union, types.UnionType)
        return args[0] if is_union and len(args) == 1 else ann

    @property
    def config_default(self) -> Any:
        """The value ``EngineConfig()`` has."""
        config = EngineConfig()
        return getattr(config.scheduler if self.field.startswith("scheduler.") else config, self.key)

    @property
    def default(self) -> Any:
        """The flag's default: :attr:`cli_default` where set, else :attr:`config_default`."""
        return self.config_default if self.cli_default is ... else self.cli_default

    @property
    def choices(self) -> tuple[str, ...] | None:
        ann = self.annotation
        if typing.get_origin(ann) is Literal:
            return tuple(typing.get_args(ann)) + self.extra_choices
        return None

    @property
    def text(self) -> str:
        return self.help or EngineConfig.model_fields[self.field].description or ""


#: every engine flag, in --help order
ENGINE_FLAGS: tuple[Flag, ...] = (
    Flag("--model", "model"),
    Flag("--pp", "scheduler.pp_size", "pipeline stages = worker processes (under torchrun: "
         "WORLD_SIZE when not given)", cli_default=None),
    Flag("--pp-layer-partition", "pp_layer_partition"),
    Flag("--tp", "tp_size"),
    Flag("--pp-schedule", "scheduler.mode", "overlapped: bubble-free, pp + 1 batches in flight; "
         "sync: one batch in flight (the baseline)"),
    Flag("--max-num-seqs", "scheduler.max_num_seqs", "live requests at most (further requests "
         "wait); also the number of slots"),
    Flag("--max-model-len", "scheduler.max_model_len", "prompt + output tokens per request at most"),
    Flag("--max-num-batched-tokens", "scheduler.max_num_batched_tokens", "tokens per step at most"),
    Flag("--max-prefill-chunk", "scheduler.max_prefill_chunk", "prefill tokens of one request per "
         "step at most"),
    Flag("--validate-mirrors", "validate_mirrors"),
    Flag("--mirror-check-kernel", "mirror_check_kernel"),
    Flag("--device", "device"),
    Flag("--dtype", "dtype"),
    Flag("--torch-threads", "torch_threads"),
    Flag("--cuda-path", "cuda_path"),
    Flag("--cpu-path", "cpu_path", "CPU ranks: exact = fp32 reference (equal to transformers); "
         "fast = quantized weights, ONNX Runtime int8 GEMMs (runtime.serve defaults to fast)"),
    Flag("--cpu-threads", "cpu_threads"),
    Flag("--cpu-pin", "cpu_pin"),
    Flag("--step-timeout", "step_timeout_s"),
    Flag("--heartbeat-timeout", "heartbeat_timeout_s"),
    Flag("--stall-timeout", "stall_timeout_s"),
    Flag("--trace-dir", "trace_dir"),
    Flag("--trace-prompts", "trace_prompts"),
    Flag("--served-model-name", "served_model_name"),
    Flag("--launcher", "launcher", "spawn: one process per rank on this machine; torchrun: the "
         "ranks are torchrun's processes (auto: torchrun when RANK, WORLD_SIZE, ... are set)",
         cli_default="auto", extra_choices=("auto",)),
    Flag("--engine-port", "engine_port"),
    Flag("--block-size", "scheduler.block_size", "tokens per KV-cache block"),
    Flag("--kv-cache-memory", "kv_cache_memory"),
    Flag("--enable-prefix-caching", "scheduler.enable_prefix_caching", "reuse the KV blocks of "
         "identical prompt prefixes across requests (--no-enable-prefix-caching: off)"),
    Flag("--enforce-eager", "enforce_eager"),
    Flag("--adaptive-lanes", "scheduler.adaptive_lanes", "overlapped: fill only as many in-flight "
         "lanes as the step-cost model says are faster (few requests: one lane, like sync)"),
    Flag("--dynamic-chunks", "scheduler.dynamic_chunks", "prefill chunks of equal estimated time "
         "as the cached prefix grows"),
    Flag("--step-cost", "step_cost"),
    Flag("--dp", "dp_size"),
    Flag("--spec-tokens", "scheduler.num_spec_tokens", "n-gram speculative decoding: draft tokens "
         "per decode row (0: off; CPU reference path and CUDA fast path)"),
    Flag("--spec-ngram", "spec_ngram"),
    Flag("--spec-probe-ngram", "scheduler.spec_probe_ngram", "speculative decoding: a decode row "
         "gets drafts only when its last N tokens occur earlier in its history (0: always)"),
    Flag("--chat-template", "chat_template"),
)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Add the engine flags of :data:`ENGINE_FLAGS` as an argument group of ``p``."""
    g = p.add_argument_group("engine")
    for f in ENGINE_FLAGS:
        ann, default = f.annotation, f.default
        if ann is bool:
            action = argparse.BooleanOptionalAction if default else "store_true"
            g.add_argument(f.name, action=action, default=default, help=f.text)
        elif f.choices is not None:
            g.add_argument(f.name, choices=f.choices, default=default, help=f.text)
        else:
            g.add_argument(f.name, type=ann, default=default, help=f.text)


def engine_config(p: argparse.ArgumentParser, args: argparse.Namespace) -> EngineConfig:
    """Build the EngineConfig from parsed flags; a bad value exits via ``p.error`` naming the flag."""
    values = {f.key: getattr(args, f.dest) for f in ENGINE_FLAGS}
    try:
        values = resolve_cli(values)
    except ValueError as exc:
        p.error(str(exc))
    args.pp = values["pp_size"]  # callers (bench) read args.pp
    nested: dict[str, Any] = {"scheduler": {}}
    for f in ENGINE_FLAGS:
        if f.field.startswith("scheduler."):
            nested["scheduler"][f.key] = values[f.key]
        else:
            nested[f.key] = values[f.key]
    if values.get("dp_size", 1) > 1 and values["launcher"] == "torchrun":  # issue #14
        p.error("--dp: data parallelism needs the spawn launcher; under torchrun run one server "
                "per pipeline")
    try:
        config = EngineConfig(**nested)
    except ValidationError as exc:
        err = exc.errors()[0]
        path = ".".join(str(x) for x in err["loc"][:2])
        if path == "scheduler" and "field" in err.get("ctx", {}):
            path = f"scheduler.{err['ctx']['field']}"
        flag = next((f.name for f in ENGINE_FLAGS if f.field == path), None)
        p.error(f"{flag or 'engine config'}: {err['msg']}")
        raise  # unreachable: p.error exits
    _check_chat_template(p, config.chat_template)
    return config


def _check_chat_template(p: argparse.ArgumentParser, name_or_path: str | None) -> None:
    """``--chat-template`` names a built-in or a readable Jinja file that compiles; otherwise exit
    via ``p.error`` before any worker starts (it was a traceback from the engine's start)."""
    if not name_or_path:
        return
    from runtime.model.chat import ChatTemplate
    from runtime.model.chat_templates import resolve_chat_template
    try:
        ChatTemplate(resolve_chat_template(name_or_path))
    except FileNotFoundError as exc:
        p.error(str(exc))
    except (OSError, ValueError) as exc:   # unreadable, not UTF-8, does not compile
        p.error(f"--chat-template: {name_or_path}: {exc}")


def _cell(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`" if isinstance(value, str) else f"{value}"


def markdown_table() -> str:
    """The docs table of the engine flags (flag, default, EngineConfig field, meaning)."""
    rows = ["| flag | default | EngineConfig field | meaning |", "|---|---|---|---|"]
    for f in ENGINE_FLAGS:
        choices = f" ({' / '.join(f.choices)})" if f.choices else ""
        text = f.text.replace("|", "\\|")
        default = f.config_default if f.default is None else f.default
        rows.append(f"| `{f.name}` | {_cell(default)} | `{f.field}` | {text}{choices} |")
    return "\n".join(rows) + "\n"


DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"
BEGIN, END = "<!-- engine-flags:begin (generated by python -m runtime.cli_common --write-docs) -->\n", \
    "<!-- engine-flags:end -->\n"


def documented_table(doc: Path = DOC) -> str:
    """The table between the markers of ``doc``."""
    text = doc.read_text()
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)]


def write_docs(doc: Path = DOC) -> None:
    """Replace the table between the markers of ``doc`` with :func:`markdown_table`."""
    text = doc.read_text()
    head, tail = text[:text.index(BEGIN) + len(BEGIN)], text[text.index(END):]
    doc.write_text(head + markdown_table() + tail)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-docs"]:
        write_docs()
    else:
        sys.stdout.write(markdown_table())
