"""Per-request sampling parameters, shared by the engine, the sampler and the HTTP server."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    """What a request asks for. Validation errors name the field (the server maps them to HTTP 400).

    Attributes:
        max_tokens: new tokens to generate at most (>= 1).
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; -1 or 0 disables.
        seed: per-request seed; equal seeds give equal samples for equal inputs.
        stop: stop strings (not included in the output text).
        stop_token_ids: extra token ids that stop the request (kept in the output ids).
        ignore_eos: keep generating past EOS (vLLM's extension).
        logprobs: return the log-probability of each sampled token and this many top alternatives
            (None: no logprobs).
    """
    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: list[str] = Field(default_factory=list, max_length=16)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
