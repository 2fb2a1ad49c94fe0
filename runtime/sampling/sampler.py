"""Batched token sampling on the last pipeline stage: one call per step, all rows at once, on device.

    batch = SamplingBatch.build(params, output_index, device)   # CPU work, once per step
    out = sample(logits, batch)                                 # logits [R, V] fp32 -> ids [R]

Per row: temperature 0 takes the argmax of the raw logits. Otherwise the logits are divided by the
temperature, cut to the top-k tokens (exactly k; a tie at the k-th value is broken arbitrarily), then to
the nucleus (a token is kept iff the mass of the tokens more likely than it is < top_p, so the
most likely token always stays), renormalised, and one token is drawn by inverse-CDF sampling with
one uniform u per row: the first token whose cumulative (fp64) mass exceeds u * total.

Randomness: u is drawn at `build` time (:mod:`runtime.sampling.batch`), on the CPU. A row with a
`seed` gets u from a splitmix64 hash of (seed, output_index) only, so its token does not depend on
the other rows, its position in the batch, or earlier steps; unseeded rows take one batched draw
from torch's global CPU generator. `sample` itself uses no RNG and, on CUDA, never syncs with the
host. (An exponential race over [R, V] noise costs ~80 ms per step at R=32, V=49152 on one CPU
thread; this ~7 ms.)

Top-k / top-p work on the K most likely tokens only (`topk`, not a full sort): K = max top_k of
the batch, or for top-p-only rows K = V on CUDA and 256 on CPU, where a row whose 256 candidates
hold less than top_p of the mass is redone over the full vocabulary (exact either way).
Logprobs are log_softmax of the raw (unscaled, unfiltered, unpenalised) logits, as vLLM returns by
default.

Penalties (rows that ask for any) come first, on the logits, before temperature and the cuts, in
vLLM's order: repetition (transformers' ``RepetitionPenaltyLogitsProcessor``, from CTRL, Keskar et
al. 2019: a logit of a token seen in the prompt or the output is divided by the penalty when
positive, multiplied when negative), then OpenAI's ``logit -= frequency * count + presence * (count
> 0)`` over the tokens generated so far (:mod:`runtime.sampling.penalties`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.sampling.batch import SamplingBatch
from runtime.sampling.logit_bias import apply_logit_bias
from runtime.sampling.penalties import TokenHistory, apply_penalties

CPU_TOP_P_CANDIDATES = 256
_BLOCK = 256


@dataclass
class SamplerOutput:
    """Attributes:
        token_ids: [R] int64, the sampled token of each row.
        logprobs: [R] fp32 log-probability of the sampled token (raw logits), or None when no row
            asked for logprobs.
        top_logprobs: ([R, k] int64 ids, [R, k] fp32 logprobs), most likely first, k =
            max(params.logprobs); None when k == 0 or no row asked. Rows slice their own k.
    """
    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column drawn per row: the first j with cumsum(probs)[j] > u * sum(probs).

    probs [N, K] >= 0 (unnormalised; zero columns are never drawn), u [N] fp64 in [0, 1).
    Returns [N] int64. Wide rows go in two levels (blocks of `_BLOCK`, then within the chosen
    block), which reads [N, K] once instead of writing an fp64 cumsum of it.
    """
    n, k = probs.shape
    if k <= 4 * _BLOCK:
        cum = probs.double().cumsum(dim=-1)
        x = (u * cum[:, -1]).unsqueeze(1)
        return torch.searchsorted(cum, x, right=True).squeeze(1).clamp_(max=k - 1)
    nb = -(-k // _BLOCK)
    padded = probs if k % _BLOCK == 0 else torch.nn.functional.pad(probs, (0, nb * _BLOCK - k))
    blocks = padded.view(n, nb, _BLOCK)
    block_mass = blocks.sum(dim=-1).double()  # [N, nb]
    block_cum = block_mass.cumsum(dim=-1)
    x = u * block_cum[:, -1]
    blk = torch.searchsorted(block_cum, x.unsqueeze(1), right=True).squeeze(1).clamp_(max=nb - 1)
    rest = x - (block_cum.gather(1, blk.unsqueeze(1)) - block_mass.gather(1, blk.unsqueeze(1))).squeeze(1)
    rows = torch.arange(n, device=probs.device)
    cum = blocks[rows, blk].double().cumsum(dim=-1)  # [N, _BLOCK]
    # rounding may put `rest` at or past the block's own total: take its last nonzero token then
    rest = torch.minimum(rest.clamp_(min=0.0), torch.nextafter(cum[:, -1], torch.zeros_like(cum[:, -1])))
    j = torch.searchsorted(cum, rest.unsqueeze(1), right=True).squeeze(1).clamp_(max=_BLOCK - 1)
    return (blk * _BLOCK + j).clamp_(max=k - 1)


def sample_cut(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor,
               num_candidates: int) -> torch.Tensor:
    """Token ids [N] int64 for rows with a top-k and/or top-p cut.

    scaled [N, V] temperature-scaled logits; top_k [N] (0 = none), top_p [N] (1 = none);
    u [N] fp64; num_candidates: K >= every row's top_k (and, for exactness without fallback,
    covering each top-p-only row's nucleus; rows whose K candidates hold less than top_p of the
    mass are redone with K = V).
    """
    vocab = scaled.shape[-1]
    k = min(num_candidates, vocab)
    vals, ids = scaled.topk(k, dim=-1)  # [N, K], most likely first
    has_k = top_k > 0
    pos = torch.arange(k, device=scaled.device)
    vals = vals.masked_fill(has_k.unsqueeze(1) & (pos.unsqueeze(0) >= top_k.unsqueeze(1)), float("-inf"))
    # top-k rows renormalise over their k tokens; the others need the full row's normaliser
    lse = torch.where(has_k, vals.logsumexp(dim=-1), scaled.logsumexp(dim=-1))
    probs = (vals - lse.unsqueeze(1)).exp()
    has_p = top_p < 1.0
    before = probs.double().cumsum(dim=-1) - probs.double()  # mass of the more likely candidates
    candidate_mass = before[:, -1] + probs[:, -1].double()
    probs = probs.masked_fill(has_p.unsqueeze(1) & (before >= top_p.double().unsqueeze(1)), 0.0)
    short = None
    if k < vocab and not scaled.is_cuda:  # on CUDA, callers pass K = V for rows without top-k
        short = (~has_k & (candidate_mass < top_p.double())).nonzero().squeeze(1)
        short = short if short.numel() else None
    out = ids.gather(1, inverse_cdf(probs, u).unsqueeze(1)).squeeze(1)
    if short is not None:  # CPU only: nucleus wider than the candidates
        out[short] = sample_cut(scaled[short], top_k[short], top_p[short], u[short], vocab)
    return out


def sample(logits: torch.Tensor, batch: SamplingBatch, history: TokenHistory | None = None) -> SamplerOutput:
    """Sample one token per row.

    Args: logits: [R, V] (any float dtype; computed in fp32); batch: this step's SamplingBatch;
        history: token history of ``batch.penalty_rows`` (needed when any row is penalised).
    Returns: SamplerOutput (token ids, and logprobs of the raw logits when any row asked).
    Raises: ValueError if logits is not [R, V] with R == batch.num_rows, or a penalised batch
        comes without history.
    """
    if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
        raise ValueError(f"logits shape {tuple(logits.shape)} != [{batch.num_rows}, V]")
    raw = logits = logits.float()
    logits = apply_logit_bias(logits, batch.logit_bias)   # logprobs stay those of `raw`
    if batch.penalty_rows is not None:
        if history is None:
            raise ValueError("penalised rows need their token history")
        logits = apply_penalties(logits, batch, history)
    ids = logits.argmax(dim=-1) if batch.any_greedy else torch.zeros_like(batch.uniform, dtype=torch.int64)
    if batch.plain_rows is not None:
        r = batch.plain_rows
        scaled = (logits[r] if r.shape[0] < logits.shape[0] else logits) / batch.temperature[r].unsqueeze(1)
        scaled = (scaled - scaled.amax(dim=-1, keepdim=True)).exp_()  # unnormalised probabilities
        ids[r] = inverse_cdf(scaled, batch.uniform[r])
    if batch.cut_rows is not None:
        r = batch.cut_rows
        on_gpu = logits.is_cuda
        k = batch.max_top_k
        if batch.top_p_only:
            k = logits.shape[-1] if on_gpu else max(k, CPU_TOP_P_CANDIDATES)
        scaled = logits[r] / batch.temperature[r].unsqueeze(1)
        ids[r] = sample_cut(scaled, batch.top_k[r], batch.top_p[r], batch.uniform[r], k)
    out = SamplerOutput(token_ids=ids)
    if batch.max_num_logprobs >= 0:
        lp = raw.log_softmax(dim=-1)
        out.logprobs = lp.gather(1, ids.unsqueeze(1)).squeeze(1)
        if batch.max_num_logprobs > 0:
            vals, top_ids = lp.topk(batch.max_num_logprobs, dim=-1)
            out.top_logprobs = (top_ids, vals)
    return out
