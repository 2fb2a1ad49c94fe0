"""The reference "model" every verification tool judges outputs against: the deterministic token
rule, the EOS and vocabulary constants, and what a client must receive for one request.

The simulator's ranks, the model checker's last rank and the invariant checker all draw tokens from
:func:`model_token`, so a stale or missing input token shows as a wrong output token. Nothing here
depends on the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EOS_TOKEN = 2       # SmolLM2's <|im_end|>
FIRST_TOKEN = 3     # sampled / prompt ids are in [FIRST_TOKEN, VOCAB)
VOCAB = 49152


@dataclass(frozen=True)
class SimRequest:
    """One request of a workload.

    Attributes:
        req_id: id.
        arrival: tick it reaches the scheduler.
        prompt: prompt token ids.
        max_tokens: new tokens allowed.
        sample_seed: seeds the token model for this request (carried in NewRequest.sampling).
        eos_at: output index the model emits EOS at (-1: never).
        ignore_eos: keep going after EOS.
        abort_at: tick the client aborts (-1: never).
        fork_of: id of an earlier request with the same prompt this one is forked from (``n`` >
            1 of the OpenAI API; :attr:`ppstate.request.RequestSpec.fork_of`), or None.
    """
    req_id: str
    arrival: int
    prompt: tuple[int, ...]
    max_tokens: int
    sample_seed: int
    eos_at: int = -1
    ignore_eos: bool = False
    abort_at: int = -1
    fork_of: str | None = None


def model_token(sample_seed: int, index: int, prev_token: int, eos_at: int) -> int:
    """The token the "model" samples as output ``index`` after input ``prev_token``.

    Deterministic in its inputs; a wrong input token (stale or missing deferred update) changes
    every later token, which is how the client check sees invariant 2/3 failures.
    """
    if index == eos_at:
        return EOS_TOKEN
    h = (sample_seed * 0x9E3779B1 + index * 0x85EBCA6B + prev_token * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 15
    return FIRST_TOKEN + (h * 0x2C1B3C6D & 0xFFFFFFFF) % (VOCAB - FIRST_TOKEN)


@dataclass
class ExpectedOutput:
    """What a client must receive for one request, computed independently of the pipeline."""
    tokens: list[int] = field(default_factory=list)
    reason: str = "length"


def expected_output(req: SimRequest, max_model_len: int) -> ExpectedOutput:
    """The full token sequence and finish reason of ``req`` if it is not aborted."""
    limit = min(req.max_tokens, max_model_len - len(req.prompt))
    exp, prev = ExpectedOutput(), req.prompt[-1]
    for k in range(limit):
        prev = model_token(req.sample_seed, k, prev, req.eos_at)
        exp.tokens.append(prev)
        if prev == EOS_TOKEN and not req.ignore_eos:
            exp.reason = "stop"
            break
    return exp
