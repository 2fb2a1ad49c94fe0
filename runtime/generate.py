"""Offline generation: ``python -m runtime.generate --prompt TEXT [--chat] --max-tokens N ...``.

Runs the prompts concurrently through the same :class:`~runtime.engine.AsyncEngine` the server
uses (``--pp N`` worker processes). With ``--json`` each prompt prints one JSON object:
``{"prompt_token_ids": [...], "token_ids": [...], "text": "...", "finish_reason": "..."}``.
"""

from __future__ import annotations

# first, before the imports below (seconds: torch, FastAPI): a Ctrl-C meanwhile prints
# "interrupted" and exits 130, not a traceback (runtime/interrupt.py); main() restores Ctrl-C
if __name__ == "__main__":
    from runtime.interrupt import quiet_start
    quiet_start()

import argparse
import asyncio
import json
import sys

from pydantic import ValidationError

from ppstate.errors import PPStateError
from runtime.cli_common import add_engine_flags, engine_config
from runtime.engine import AsyncEngine, EngineDeadError, RequestRejected
from runtime.sampling_params import SamplingParams
from runtime.engine.torchrun import run_remote_rank
from runtime.interrupt import started
from runtime.model.errors import ModelError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.generate", description=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (a user message with --chat)")
    src.add_argument("--prompt-file", help="JSON list of prompts (strings, or message lists "
                     "with --chat)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    add_engine_flags(p)
    return p


def load_prompts(p: argparse.ArgumentParser, args: argparse.Namespace) -> list:
    """Prompts from --prompt or --prompt-file (errors name the flag)."""
    if args.prompt is not None:
        if not args.prompt:
            p.error("--prompt: must not be empty")
        return [[{"role": "user", "content": args.prompt}] if args.chat else args.prompt]
    try:
        with open(args.prompt_file, encoding="utf-8") as fh:
            prompts = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        p.error(f"--prompt-file: {exc}")
    if not isinstance(prompts, list) or not prompts:
        p.error("--prompt-file: must hold a non-empty JSON list")
    if args.chat:
        prompts = [[{"role": "user", "content": x}] if isinstance(x, str) else x for x in prompts]
    elif not all(isinstance(x, str) for x in prompts):
        p.error("--prompt-file: without --chat every prompt must be a string")
    return prompts


#: SamplingParams field -> the flag that sets it
_SAMPLING_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p",
                   "top_k": "--top-k", "seed": "--seed"}


def sampling_params(p: argparse.ArgumentParser, args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the flags; a bad value exits via ``p.error`` naming the flag."""
    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                              ignore_eos=args.ignore_eos)
    except ValidationError as exc:
        err = exc.errors()[0]
        p.error(f"{_SAMPLING_FLAGS.get(str(err['loc'][0]), 'sampling')}: {err['msg']}")
        raise  # unreachable: p.error exits


def tokenize_all(p: argparse.ArgumentParser, prompts: list, config, max_tokens: int) -> list:
    """Prompt token ids (``--chat`` prompts rendered with ``--chat-template`` when given), checked
    against ``--max-model-len`` before any worker starts."""
    from runtime.model.registry import resolve_model_path
    from runtime.model.chat_templates import load_serving_tokenizer
    tok = load_serving_tokenizer(resolve_model_path(config.model), config.chat_template)
    out = []
    for i, pr in enumerate(prompts):
        ids = tok.encode_chat(pr) if isinstance(pr, list) else tok.encode(pr)
        if not ids:
            p.error(f"prompt {i} is empty")
        if max_tokens > config.scheduler.output_room(len(ids)):
            p.error(f"--max-tokens: prompt {i} has {len(ids)} tokens; with --max-tokens "
                    f"{max_tokens} that exceeds --max-model-len {config.scheduler.max_model_len}")
        out.append(ids)
    return out


async def _one(engine: AsyncEngine, i: int, ids: list[int], params: SamplingParams) -> dict:
    token_ids, text, reason = [], "", None
    async for out in engine.add_request(f"gen-{i}", ids, params):
        token_ids += out.new_token_ids
        text += out.new_text
        reason = out.finish_reason or reason
        if out.error:
            raise EngineDeadError(out.error)
    return {"prompt_token_ids": ids, "token_ids": token_ids, "text": text, "finish_reason": reason}


async def run(prompts: list[list[int]], params: SamplingParams, config) -> list[dict]:
    """Start an engine, run every prompt (token ids) concurrently, shut the engine down."""
    from runtime.dp.replicas import start_engine
    engine = await start_engine(config)  # one pipeline, or --dp replicas
    try:
        return await asyncio.gather(*(_one(engine, i, ids, params) for i, ids in enumerate(prompts)))
    finally:
        await engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    prompts = load_prompts(p, args)
    params = sampling_params(p, args)
    config = engine_config(p, args)
    started()   # Ctrl-C raises KeyboardInterrupt again: asyncio.run and the except below
    if (status := run_remote_rank(config)) is not None:  # torchrun RANK > 0: a worker, no engine
        return status
    try:
        ids = tokenize_all(p, prompts, config, params.max_tokens)
        results = asyncio.run(run(ids, params, config))
    except (EngineDeadError, RequestRejected, PPStateError, ModelError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    for r in results:
        print(json.dumps(r, ensure_ascii=False) if args.json else r["text"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
