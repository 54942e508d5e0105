"""What a step costs, learned from the steps the engine ran:
``seconds ~= fixed + per_token * tokens + per_pair * attention pairs``.

*Tokens* are the step's scheduled tokens (the linears' rows); *attention pairs* are the (query, key)
pairs its causal attention computes: a request computing ``n`` tokens from position ``start`` adds
``n * (start + (n + 1) / 2)``. The pair term is what makes the later chunks of a long prompt dearer than
its first ones.

The scheduler uses the model to size prefill chunks by a target step time instead of a fixed token
count (``EngineConfig.prefill_step_target``): while requests decode, a step's prompt tokens are as many
as fit in ``prefill_step_target`` times the step its decode rows alone would take. On a CPU a step's fixed
part (a full read of the weights, the per-layer Python) and its per-token part are of the same order, so
the chunk stays near a hundred tokens; on a GPU the per-token part is tiny and the chunk grows to the
whole budget; on a slow or shared machine it follows what the machine does now.

The fit is exponentially weighted least squares over recent steps (forgetting factor :data:`DECAY` per
step; normal equations of three terms, solved at each observation), with the coefficients kept at or
above 0. It is only used once the steps seen spread over enough token counts to separate the fixed and
per-token parts (:meth:`StepCostModel.ready`).
"""

from __future__ import annotations

import math

import numpy as np

DECAY = 0.98  # weight of the past per observed step (an effective window of about 50 steps)
MIN_SPREAD = 16.0  # tokens: weighted standard deviation of the token counts needed before the fit is used
_RIDGE = 1e-9  # relative regularisation of the normal equations (steps that never vary a term)


def attention_pairs(start: int, num_tokens: int) -> float:
    """(query, key) pairs of causal attention for ``num_tokens`` new tokens after ``start`` cached ones."""
    return num_tokens * (start + (num_tokens + 1) / 2)


class StepCostModel:
    """Online fit of ``step seconds = fixed + per_token * tokens + per_pair * attention pairs``.

    Attributes:
        fixed: seconds a step costs whatever it computes (the intercept), None before :meth:`ready`.
        per_token: seconds per scheduled token, None before :meth:`ready`.
        per_pair: seconds per attention (query, key) pair, None before :meth:`ready`.
    """

    def __init__(self, decay: float = DECAY) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self.fixed: float | None = None
        self.per_token: float | None = None
        self.per_pair: float | None = None

    def observe(self, num_tokens: int, seconds: float, pairs: float | None = None) -> None:
        """Add one step: ``num_tokens`` scheduled tokens (>= 1) and ``pairs`` attention pairs (default: as
        many as tokens, i.e. decode rows of no context) that took ``seconds`` (> 0). Others are ignored (an
        empty or paused step says nothing about the machine)."""
        if num_tokens < 1 or not (seconds > 0.0 and math.isfinite(seconds)):
            return
        if pairs is not None and not (pairs >= 0.0 and math.isfinite(pairs)):
            return
        x = np.array([1.0, float(num_tokens), float(num_tokens if pairs is None else pairs)])
        self._xtx = self.decay * self._xtx + np.outer(x, x)
        self._xty = self.decay * self._xty + x * seconds
        w = self._xtx[0, 0]
        mean = self._xtx[0, 1] / w
        if self._xtx[1, 1] / w - mean * mean < MIN_SPREAD**2:
            return  # keep the previous fit (or none): these steps all computed about as many tokens
        self._solve()

    def _solve(self) -> None:
        a, y = self._xtx, self._xty
        scale = np.sqrt(np.diag(a)) + 1e-300
        a_n = a / np.outer(scale, scale)
        active = [0, 1, 2]
        coef = np.zeros(3)
        for _ in range(3):  # drop a term whose fitted cost is negative, refit the others
            idx = np.array(active)
            sol = np.linalg.solve(a_n[np.ix_(idx, idx)] + _RIDGE * np.eye(len(idx)), (y / scale)[idx])
            coef = np.zeros(3)
            coef[idx] = sol / scale[idx]
            negative = [i for i in active if coef[i] < 0]
            if not negative:
                break
            active = [i for i in active if i not in negative]
            if not active:
                coef = np.zeros(3)
                break
        self.fixed, self.per_token, self.per_pair = (float(c) for c in np.maximum(coef, 0.0))

    def ready(self) -> bool:
        """Whether the fit separates the fixed and per-token parts yet."""
        return self.per_token is not None

    def predict(self, num_tokens: int, pairs: float | None = None) -> float | None:
        """Seconds a step of ``num_tokens`` tokens and ``pairs`` attention pairs (default: ``num_tokens``)
        should take, or None before :meth:`ready`."""
        if self.fixed is None or self.per_token is None or self.per_pair is None:
            return None
        return self.fixed + self.per_token * num_tokens + self.per_pair * (num_tokens if pairs is None else pairs)

    def chunk_tokens(self, decode_tokens: int, target: float, budget: int, decode_pairs: float | None = None,
                     prompt_start: int = 0) -> int | None:
        """Prompt tokens to add to a step of ``decode_tokens`` decode rows (``decode_pairs`` attention pairs)
        so that the step takes about ``target`` times the decode rows alone, for a prompt whose chunk
        starts after ``prompt_start`` computed tokens (tokens, between 1 and ``budget``), or None before
        :meth:`ready`."""
        base = self.predict(decode_tokens, decode_pairs)
        if base is None or self.per_token is None or self.per_pair is None:
            return None
        # per_token * x + per_pair * x * (start + (x + 1) / 2) = (target - 1) * base, for x >= 0
        qa = self.per_pair / 2
        qb = self.per_token + self.per_pair * (prompt_start + 0.5)
        qc = (target - 1.0) * base
        if qa <= 0.0 and qb <= 0.0:
            return budget
        x = qc / qb if qa <= 0.0 else (-qb + np.sqrt(qb * qb + 4 * qa * qc)) / (2 * qa)
        if not math.isfinite(x):  # an overflow: more than any budget
            return budget
        return int(max(1, min(budget, round(float(x)))))
