"""Logits -> next token per request: greedy, temperature, top-k, top-p, min-p, repetition / presence /
frequency penalties, logit bias, allowed token ids, min_tokens, per-request seeded generators, and the
logprobs of the sampled tokens.

Order of the steps (vLLM v1's ``Sampler``: logprobs of the raw logits, logits processors, penalties,
temperature, min-p, then top-k / top-p):

0. rows that asked for logprobs: log-softmax of the raw logits (float32), kept for the end;
1. logits processors (rows that use them): allowed token ids, min_tokens (EOS and stop token ids masked
   while fewer than ``min_tokens`` tokens exist), logit bias, presence / frequency penalties; then the
   repetition penalty on every row that asks for it (greedy rows too: they change the argmax);
2. greedy rows (``temperature < 1e-5``, as vLLM's ``_SAMPLING_EPS``) take the argmax and stop there;
3. random rows: divide by the temperature, drop tokens below ``min_p`` x the top probability, keep the
   ``top_k`` best, keep the top-p nucleus of what is left, draw one token by inverse-CDF sampling with
   one uniform number from the row's own ``torch.Generator``.

Every step except the draw is vectorised over the rows that need it; the only per-row Python work is
reading each request's parameters and drawing one float64 uniform from its generator. The inverse-CDF
draw needs one random number per row, where the exponential-race (Gumbel) trick needs ``vocab_size`` and
``torch.multinomial`` a pass over the whole row, and top-p looks first at only the best
``top_p_candidates`` tokens (``topk``) instead of sorting the vocabulary (measured in docs/performance.md).
"""

from __future__ import annotations

import itertools
import math
import random
import weakref
from collections.abc import Sequence

import torch

import kernels
from engine.request import Request

# Temperatures below this are greedy, as in vLLM (``_SAMPLING_EPS``): dividing by them overflows.
_GREEDY_EPS = 1e-5
# Block length of the two-level inverse CDF over the full vocabulary (elements).
_CDF_BLOCK = 256
_SEED_MASK = (1 << 64) - 1


class Sampler:
    """Picks the next token of every request in a batch from its logits row.

    Algorithms and their sources:

    * greedy: ``argmax`` over the float32 values of the logits. When every row is greedy, with no
      penalty, processor or logprobs, one pass in the logits' own dtype (:func:`kernels.logits_argmax`,
      C++ on CPU: about 20x torch's cast + argmax on a [64 x 49152] step); otherwise ``torch.argmax``
      over ``logits.float()``. Ties go to the lowest token id either way.
    * repetition penalty: CTRL (Keskar et al. 2019, arXiv:1909.05858, section 4.1) as implemented by
      transformers' ``RepetitionPenaltyLogitsProcessor`` and vLLM's ``apply_penalties``: for every
      distinct token of ``prompt_token_ids + output_token_ids``, a positive logit is divided by the
      penalty and a negative one multiplied by it. Applied with one flat gather/scatter over all
      penalised rows.
    * temperature: ``logits / temperature``.
    * min-p (Nguyen et al. 2024, arXiv:2407.01082; vLLM / transformers ``MinPLogitsWarper``): drop
      tokens with ``p < min_p * p_max``, computed as ``logit < max_logit + log(min_p)`` (no softmax).
    * top-k: keep the ``top_k`` highest logits (``torch.topk``); ties at the k-th value are broken by
      ``topk``'s order.
    * top-p, nucleus sampling (Holtzman et al. 2020, arXiv:1904.09751), with vLLM's / transformers'
      rule: a token is kept iff the probability mass of the tokens ranked strictly above it is
      ``< top_p`` (so the best token is always kept), computed on the distribution left by min-p and
      top-k. Instead of sorting the whole vocabulary (slow on the CPU, docs/performance.md) it looks at the
      best ``top_p_candidates`` tokens (``topk``); a row whose nucleus is larger is retried with 16x as
      many, and a full sort only as the last resort.
    * the draw: inverse-CDF sampling with one uniform ``u`` in [0, 1) per row from that row's generator:
      the chosen token is the first whose cumulative probability exceeds ``u`` x the total. Over the
      full vocabulary it is done in two levels (blocks of 256 tokens, then inside the chosen block) so
      that float32 rounding of a long cumulative sum cannot hide small probabilities; over a candidate
      set the cumulative sum is float64. A zero-probability token can never be chosen.

    Per-request generators: a request with ``sampling_params.seed`` gets a CPU ``torch.Generator``
    whose state comes from all 64 bits of the seed (:func:`seeded_generator`; ``manual_seed`` would keep
    32) the first time it is sampled, kept in ``request.generator``; each sampling step of a
    random request draws exactly one number from it, so its tokens depend only on its own logits and its
    seed, never on the other rows or on its row index (up to float rounding differences in the logits
    themselves). An unseeded random request also gets its own generator, seeded from this sampler's
    ``random.Random(seed)``: a whole run is reproducible when the sampler is built with a seed.
    Greedy requests never get a generator. The generators live on the CPU whatever the logits' device:
    the uniforms are moved to the device in one transfer.

    Logprobs (``sampling_params.logprobs`` not None): the sampled token's logprob and the top
    ``logprobs`` ``(token id, logprob)`` pairs from the log-softmax of the *raw* logits (before any
    processor, penalty, temperature or truncation: vLLM's default ``raw_logprobs``), appended to
    ``request.output_logprobs`` at the index the token takes in ``output_token_ids``.
    """

    def __init__(self, seed: int | None = None, top_p_candidates: int = 64) -> None:
        """Args:
            seed: seeds the generators of requests that have no ``seed`` of their own (None: from the OS).
            top_p_candidates: how many of the best tokens the first top-p pass looks at (>= 1).

        Raises:
            ValueError: ``top_p_candidates < 1``.
        """
        if top_p_candidates < 1:
            raise ValueError(f"top_p_candidates must be >= 1, got {top_p_candidates}")
        self._seed_rng = random.Random(seed)
        self.top_p_candidates = int(top_p_candidates)
        # request -> (prompt length, unique prompt token ids as an int64 tensor on the logits' device)
        self._prompt_ids: weakref.WeakKeyDictionary[Request, tuple[int, torch.Tensor]] = (
            weakref.WeakKeyDictionary()
        )

    # ------------------------------------------------------------------ public
    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """Pick one token per request.

        Args:
            logits: ``[num_requests, vocab_size]``, any floating dtype (computed in float32), on the CPU
                or a CUDA device; row i belongs to ``requests[i]``. It is never modified.
            requests: the requests, in row order; read: ``sampling_params``, ``prompt_token_ids``,
                ``output_token_ids`` (repetition penalty) and ``generator`` (created here if needed).

        Returns:
            ``num_requests`` token ids (python ints in ``[0, vocab_size)``), in row order.

        Raises:
            ValueError: ``logits`` is not 2-D, not floating point, or its row count differs from
                ``len(requests)``; a token of a penalised request's history is ``>= vocab_size``.
        """
        n = len(requests)
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(f"logits must be [num_requests={n}, vocab_size], got {tuple(logits.shape)}")
        if not logits.is_floating_point():
            raise ValueError(f"logits must be floating point, got {logits.dtype}")
        if n == 0:
            return []
        params = [r.sampling_params for r in requests]
        greedy = [p.temperature < _GREEDY_EPS for p in params]
        penalised = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        processed = [i for i, (r, p) in enumerate(zip(requests, params))
                     if p.needs_logits_processing(len(r.output_token_ids))]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not penalised and not processed and not lp_rows and all(greedy):
            # the fast path: one pass over the logits in their own dtype (kernels.logits_argmax equals
            # argmax over their float32 values), one transfer
            return self._with_logprobs(kernels.logits_argmax(logits)[0].tolist(), None, lp_rows, requests)
        x = logits.float()
        # logprobs of the raw model output (vLLM's default), before anything below changes the logits
        raw_logprobs = None
        if lp_rows:
            sel = x if len(lp_rows) == n else x.index_select(0, torch.tensor(lp_rows, device=x.device))
            raw_logprobs = torch.log_softmax(sel, dim=-1)
        if not penalised and not processed and all(greedy):
            # the fast path: one argmax, one transfer
            return self._with_logprobs(x.argmax(dim=-1).tolist(), raw_logprobs, lp_rows, requests)

        if penalised or processed:
            if x is logits:
                x = x.clone(memory_format=torch.contiguous_format)
            elif not x.is_contiguous():
                x = x.contiguous()
            if processed:
                self._apply_processors(x, [requests[i] for i in processed], processed)
            if penalised:
                self._apply_repetition_penalty(x, [requests[i] for i in penalised], penalised)

        random_rows = [i for i, g in enumerate(greedy) if not g]
        if not random_rows:
            return self._with_logprobs(x.argmax(dim=-1).tolist(), raw_logprobs, lp_rows, requests)
        out: list[int] = [0] * n
        greedy_rows = [i for i, g in enumerate(greedy) if g]
        if greedy_rows:
            idx = torch.tensor(greedy_rows, device=x.device)
            for i, t in zip(greedy_rows, x.index_select(0, idx).argmax(dim=-1).tolist()):
                out[i] = t
            xr = x.index_select(0, torch.tensor(random_rows, device=x.device))
        else:
            xr = x if x is not logits else x.clone()
        # xr is now our own float32 copy of the random rows: modified in place below
        rq = [requests[i] for i in random_rows]
        rp = [params[i] for i in random_rows]
        # one draw per random row, always (the stream of a seeded request depends only on its steps)
        u = torch.tensor([self._uniform(r) for r in rq], dtype=torch.float64).to(x.device)
        tokens = self._sample_random(xr, rp, u)
        for i, t in zip(random_rows, tokens):
            out[i] = t
        return self._with_logprobs(out, raw_logprobs, lp_rows, requests)

    # ------------------------------------------------------------------ logprobs
    @staticmethod
    def _with_logprobs(tokens: list[int], raw_logprobs: torch.Tensor | None, rows: list[int],
                       requests: Sequence[Request]) -> list[int]:
        """Record, on each request of ``rows`` (those asking for logprobs), the sampled token's logprob and
        the top ``sampling_params.logprobs`` alternatives from ``raw_logprobs`` (``[len(rows), vocab]``),
        at the position the token will take in ``output_token_ids``. Returns ``tokens``."""
        if raw_logprobs is None:
            return tokens
        device = raw_logprobs.device
        chosen_ids = torch.tensor([tokens[i] for i in rows], dtype=torch.int64, device=device)
        chosen = raw_logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
        ks: list[int] = []
        for i in rows:
            k = requests[i].sampling_params.logprobs
            assert k is not None  # rows are the requests that ask for logprobs
            ks.append(k)
        kmax = min(max(ks), raw_logprobs.shape[1])
        top_vals: list[list[float]] = [[] for _ in rows]
        top_ids: list[list[int]] = [[] for _ in rows]
        if kmax > 0:
            vals, ids = raw_logprobs.topk(kmax, dim=-1, sorted=True)
            top_vals, top_ids = vals.tolist(), ids.tolist()
        for j, i in enumerate(rows):
            req = requests[i]
            k = ks[j]
            pos = len(req.output_token_ids)
            del req.output_logprobs[pos:]  # a row sampled again after a failed step overwrites its entry
            req.output_logprobs.append((tokens[i], chosen[j], list(zip(top_ids[j][:k], top_vals[j][:k]))))
        return tokens

    # ------------------------------------------------------------------ logits processors
    def _apply_processors(self, x: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
        """In place on ``x`` (float32, contiguous, owned), in vLLM v1's order: allowed token ids, min_tokens
        (EOS and stop token ids at -inf while fewer than ``min_tokens`` tokens exist), logit bias, then the
        presence / frequency penalties over the output tokens (OpenAI's formula:
        ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``)."""
        vocab = x.shape[1]
        device = x.device
        for row, req in zip(rows, requests):
            sp = req.sampling_params
            xr = x[row]
            if sp.allowed_token_ids is not None:
                keep = torch.zeros(vocab, dtype=torch.bool, device=device)
                keep[torch.tensor([t for t in sp.allowed_token_ids if t < vocab], dtype=torch.int64,
                                  device=device)] = True
                xr.masked_fill_(~keep, -math.inf)
            if len(req.output_token_ids) < sp.min_tokens:
                assert sp.stop_token_ids is not None  # a list since SamplingParams.__post_init__
                stops = set(sp.stop_token_ids)
                if not sp.ignore_eos:
                    stops |= set(req.eos_token_ids)
                banned = [t for t in stops if 0 <= t < vocab]
                if banned:
                    xr[torch.tensor(banned, dtype=torch.int64, device=device)] = -math.inf
            if sp.logit_bias:
                ids = [t for t in sp.logit_bias if t < vocab]
                if ids:
                    bias = torch.tensor([float(sp.logit_bias[t]) for t in ids], dtype=torch.float32, device=device)
                    xr.index_add_(0, torch.tensor(ids, dtype=torch.int64, device=device), bias)
            if (sp.presence_penalty or sp.frequency_penalty) and req.output_token_ids:
                out_ids = torch.tensor(req.output_token_ids, dtype=torch.int64).clamp_(0, vocab - 1).to(device)
                counts = torch.bincount(out_ids, minlength=vocab)[:vocab].to(torch.float32)
                xr.sub_(counts * float(sp.frequency_penalty) + (counts > 0).float() * float(sp.presence_penalty))

    # ------------------------------------------------------------------ generators
    def _uniform(self, request: Request) -> float:
        """One float64 uniform in [0, 1) from the request's generator (created on first use)."""
        g = request.generator
        if g is None:
            seed = request.sampling_params.seed
            if seed is None:
                seed = self._seed_rng.getrandbits(64)
            g = seeded_generator(seed)
            request.generator = g
        return torch.rand((), dtype=torch.float64, generator=g).item()

    # ------------------------------------------------------------------ repetition penalty
    def _prompt_tensor(self, request: Request, device: torch.device) -> torch.Tensor:
        """Distinct prompt token ids of ``request`` as int64 on ``device``, cached per request."""
        cached = self._prompt_ids.get(request)
        n = len(request.prompt_token_ids)
        if cached is not None and cached[0] == n and cached[1].device == device:
            return cached[1]
        t = torch.unique(torch.tensor(request.prompt_token_ids, dtype=torch.int64)).to(device)
        self._prompt_ids[request] = (n, t)
        return t

    def _apply_repetition_penalty(self, x: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
        """In place on ``x`` (float32, contiguous ``[num_rows, vocab]``): CTRL penalty on ``rows``.

        One flat index ``row * vocab + token`` over every (row, history token) pair, built from the
        cached distinct prompt ids and this step's output ids; duplicates write the same value.
        """
        vocab = x.shape[1]
        device = x.device
        prompt = [self._prompt_tensor(r, device) for r in requests]
        outputs = [r.output_token_ids for r in requests]
        row_t = torch.tensor(rows, dtype=torch.int64, device=device)
        counts = [len(p) for p in prompt] + [len(o) for o in outputs]
        if sum(counts) == 0:
            return
        out_ids = torch.tensor(list(itertools.chain.from_iterable(outputs)), dtype=torch.int64).to(device)
        ids = torch.cat(prompt + [out_ids])
        if ids.numel() and (int(ids.max()) >= vocab or int(ids.min()) < 0):
            raise ValueError(f"a token id of a penalised request is outside [0, {vocab})")
        counts_t = torch.tensor(counts, dtype=torch.int64, device=device)
        row_of = torch.cat([row_t, row_t]).repeat_interleave(counts_t)
        penalty = torch.tensor(
            [r.sampling_params.repetition_penalty for r in requests], dtype=torch.float32, device=device
        )
        pen_of = torch.cat([penalty, penalty]).repeat_interleave(counts_t)
        flat = x.view(-1)
        pos = row_of * vocab + ids
        v = flat[pos]
        flat[pos] = torch.where(v > 0, v / pen_of, v * pen_of)

    # ------------------------------------------------------------------ random rows
    def _sample_random(self, x: torch.Tensor, params: list, u: torch.Tensor) -> list[int]:
        """Temperature, min-p, top-k, top-p and the draw for random rows.

        Args:
            x: ``[R, vocab]`` float32, owned (modified in place).
            params: the R rows' ``SamplingParams``.
            u: ``[R]`` float64 uniforms in [0, 1), on ``x.device``.
        """
        r, vocab = x.shape
        device = x.device
        temps = [p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            x.div_(torch.tensor(temps, dtype=torch.float32, device=device).unsqueeze(1))
        min_ps = [p.min_p for p in params]
        if any(m > 0.0 for m in min_ps):
            log_min_p = torch.tensor(
                [math.log(m) if m > 0.0 else -math.inf for m in min_ps], dtype=torch.float32, device=device
            )
            thr = x.amax(dim=-1) + log_min_p
            x.masked_fill_(x < thr.unsqueeze(1), -math.inf)

        top_ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        top_ps = [p.top_p for p in params]
        trunc = [i for i in range(r) if top_ks[i] > 0 or top_ps[i] < 1.0]
        out: list[int] = [0] * r
        full = [i for i in range(r) if not (top_ks[i] > 0 or top_ps[i] < 1.0)]
        if full:
            xf = x if len(full) == r else x.index_select(0, torch.tensor(full, device=device))
            uf = u if len(full) == r else u[torch.tensor(full, device=device)]
            for i, t in zip(full, _draw_full(xf, uf).tolist()):
                out[i] = t
        if trunc:
            xt = x if len(trunc) == r else x.index_select(0, torch.tensor(trunc, device=device))
            ut = u if len(trunc) == r else u[torch.tensor(trunc, device=device)]
            ks = [top_ks[i] for i in trunc]
            ps = [top_ps[i] for i in trunc]
            for i, t in zip(trunc, self._draw_truncated(xt, ks, ps, ut)):
                out[i] = t
        return out

    def _draw_truncated(self, x: torch.Tensor, ks: list[int], ps: list[float], u: torch.Tensor) -> list[int]:
        """Top-k and/or top-p then the draw, over a candidate set from ``topk``.

        Args:
            x: ``[R, vocab]`` float32 logits (temperature and min-p applied).
            ks: per row top-k (0 = off), ps: per row top-p (1.0 = off).
            u: ``[R]`` float64 uniforms.

        Returns:
            R token ids.
        """
        r, vocab = x.shape
        device = x.device
        first = max(max(ks), self.top_p_candidates if any(k == 0 for k in ks) else 0)
        rows = list(range(r))
        out: list[int] = [0] * r
        width = min(first, vocab)
        while rows:
            sub = x if len(rows) == r else x.index_select(0, torch.tensor(rows, device=device))
            sk = [ks[i] for i in rows]
            sp = [ps[i] for i in rows]
            vals, idx = sub.topk(width, dim=-1, sorted=True)
            if any(k > 0 for k in sk):
                kt = torch.tensor([k if k > 0 else width for k in sk], device=device)
                vals.masked_fill_(torch.arange(width, device=device).unsqueeze(0) >= kt.unsqueeze(1), -math.inf)
            # the normaliser: over the top-k candidates when top-k is on, else over the whole row
            lse = torch.logsumexp(vals, dim=-1)
            if any(k == 0 for k in sk):
                no_k = torch.tensor([k == 0 for k in sk], device=device)
                lse = torch.where(no_k, torch.logsumexp(sub, dim=-1), lse)
            probs = torch.exp(vals - lse.unsqueeze(1)).double()
            cum = probs.cumsum(dim=-1)
            done = [True] * len(rows)
            if any(p < 1.0 for p in sp):
                pt = torch.tensor(sp, dtype=torch.float64, device=device).unsqueeze(1)
                probs.masked_fill_(cum - probs >= pt, 0.0)
                if width < vocab:
                    # a row without top-k whose candidates hold less than top_p of the mass has a larger
                    # nucleus: retry it with more candidates
                    short = (cum[:, -1] < pt[:, 0]).tolist()
                    done = [not (s and k == 0) for s, k in zip(short, sk)]
            us = u if len(rows) == r else u[torch.tensor(rows, device=device)]
            pos = _inverse_cdf(probs, us)
            tok = idx.gather(1, pos.unsqueeze(1)).squeeze(1).tolist()
            retry = []
            for j, i in enumerate(rows):
                if done[j]:
                    out[i] = tok[j]
                else:
                    retry.append(i)
            rows = retry
            width = min(width * 16, vocab)
        return out


# Layout of a CPU torch.Generator's state (``get_state()``, 5056 bytes): the initial seed (uint64) at 0, the
# Mersenne Twister's ``left`` (int32) at 8, ``seeded`` (int32) at 12, ``next`` (uint64) at 16, then its 624
# state words, each stored as a uint64, from byte 24. Checked on a template before use.
_MT_STATE_WORDS = 624
_MT_STATE_OFFSET = 24
_CPU_STATE_BYTES = 5056


def seeded_generator(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` whose Mersenne Twister state depends on all 64 bits of ``seed``.

    ``torch.Generator.manual_seed`` keeps only the low 32 bits (its MT19937 is seeded with a uint32), so
    seeds 11 and 11 + 2**32 would give the same stream. Instead the 624-word state is Python's
    ``random.Random(seed mod 2**64)`` state (MT19937 ``init_by_array`` over the seed's 32-bit words, which
    uses every bit), written into the generator's state; the initial seed field keeps the 64-bit value.
    Signed seeds are taken modulo 2**64 (distinct signed 64-bit seeds stay distinct). When the state
    layout is not the expected one (another torch build), it falls back to ``manual_seed`` of a 64-bit
    mix of the seed folded to 32 bits.
    """
    useed = int(seed) & _SEED_MASK
    g = torch.Generator(device="cpu")
    g.manual_seed(useed & 0xFFFFFFFF)
    state = g.get_state()
    words = state[_MT_STATE_OFFSET:_MT_STATE_OFFSET + 8 * _MT_STATE_WORDS].view(torch.int64)
    if (state.numel() != _CPU_STATE_BYTES or int(state[:8].view(torch.int64)) & _SEED_MASK != useed & 0xFFFFFFFF
            or int(words[0]) != useed & 0xFFFFFFFF):
        mixed = (useed * 0x9E3779B97F4A7C15) & _SEED_MASK
        g.manual_seed((mixed ^ (mixed >> 32)) & 0xFFFFFFFF)
        return g
    mt = random.Random(useed).getstate()[1][:_MT_STATE_WORDS]
    state = state.clone()
    state[_MT_STATE_OFFSET:_MT_STATE_OFFSET + 8 * _MT_STATE_WORDS].view(torch.int64).copy_(
        torch.tensor(mt, dtype=torch.int64))
    state[:8].view(torch.int64).fill_(useed - (1 << 64) if useed >= 1 << 63 else useed)
    g.set_state(state)
    return g


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw over short rows.

    Args:
        weights: ``[R, N]`` non-negative, unnormalised (float64 recommended), each row with a positive sum.
        u: ``[R]`` float64 uniforms in [0, 1).

    Returns:
        ``[R]`` int64 positions in ``[0, N)``, each with a positive weight: the first position whose
        cumulative weight is > ``u * total`` (``searchsorted(..., right=True)``).
    """
    cum = weights.double().cumsum(dim=-1)
    total = cum[:, -1:]
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, target, right=True).squeeze(1).clamp_(max=weights.shape[1] - 1)


def _draw_full(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw over the whole vocabulary, in two levels.

    Level one: float32 sums of blocks of 256 probabilities, float64 cumulative sum over the blocks,
    pick a block; level two: float64 cumulative sum inside the chosen block, pick the token. The
    rounding error of a token's share is then relative to its block's mass, not to the total.

    Args:
        x: ``[R, vocab]`` float32 logits (finite maximum per row; ``-inf`` = excluded).
        u: ``[R]`` float64 uniforms in [0, 1).

    Returns:
        ``[R]`` int64 token ids.
    """
    r, vocab = x.shape
    probs = torch.softmax(x, dim=-1)
    nb = -(-vocab // _CDF_BLOCK)
    pad = nb * _CDF_BLOCK - vocab
    if pad:
        probs = torch.nn.functional.pad(probs, (0, pad))
    blocks = probs.view(r, nb, _CDF_BLOCK)
    block_mass = blocks.sum(dim=-1).double()  # [R, nb]
    cum = block_mass.cumsum(dim=-1)
    total = cum[:, -1:]
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    b = torch.searchsorted(cum, target, right=True).clamp_(max=nb - 1)  # [R, 1]
    before = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(target))
    frac = ((target - before) / block_mass.gather(1, b)).clamp_(0.0, 1.0)  # position inside the block
    inner = blocks.gather(1, b.unsqueeze(2).expand(r, 1, _CDF_BLOCK)).squeeze(1)  # [R, 256]
    pos = _inverse_cdf(inner, frac.squeeze(1).clamp(max=1.0 - 2.0**-53))
    # a row with no usable mass (NaN) could land in the padding: never return an id past the vocabulary
    return (b.squeeze(1) * _CDF_BLOCK + pos).clamp_(max=vocab - 1)
