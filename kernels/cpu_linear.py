"""Linear layers on weights prepacked for oneDNN (CPU inference).

:func:`prepack_linears` replaces the ``nn.Linear`` modules of a transformers decoder (the projections
inside its decoder layers, and optionally ``lm_head``) by :class:`PackedLinear`, which keeps the weight
reordered once into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``) and calls
``torch.ops.mkldnn._linear_pointwise``: no per-call weight reorder. Each distinct weight shape is
calibrated first, on random inputs of a few row counts: it is packed only where the packed call gives
bit-identical results to ``F.linear`` and measures faster. On this kind of CPU (AVX512-BF16) that
holds for bfloat16 (1.4-2x at 1-8 rows, ~1.1x at 64, ~1.0x at 256+ rows); float32 results differ
in the last bits (oneDNN's summation order differs from MKL's), so float32 stays on ``F.linear``;
float16 packing needs AVX512-FP16 / AVX-NE-CONVERT.

The replaced modules have no ``weight`` parameter (the packed tensor is an opaque oneDNN tensor, kept
as a non-persistent buffer): call this after loading weights, for inference only (no autograd). With
tied embeddings, packing ``lm_head`` keeps the embedding matrix and adds a packed copy (its size).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

_log = logging.getLogger(__name__)


def available() -> bool:
    """Whether torch has oneDNN (mkldnn) support on this CPU."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` prepacked for oneDNN. Same inputs and outputs as the ``nn.Linear``
    it replaces (any leading dimensions)."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            self.register_buffer("packed_weight", _pack(linear.weight) if packed is None else packed, persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, oneDNN-packed"


def _median_time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


_VERDICTS: dict[tuple, tuple[bool, float]] = {}  # per process: (shape, dtype, bias, rows) -> calibrate()


def calibrate(linear: nn.Linear, rows=(1, 16, 64), reps: int = 3, seed: int = 0) -> tuple[bool, float]:
    """Check a linear layer's shape: ``(equal, speedup)``, where ``equal`` says that the packed call
    gives bit-identical outputs to ``F.linear`` for every row count in ``rows`` and ``speedup`` is the
    geometric mean of ``time(F.linear) / time(packed)`` over them (A/B interleaved, medians).
    ``(False, 0.0)`` when the packed call is not supported here."""
    w, b = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
    try:
        packed = _pack(w)
    except RuntimeError:
        return False, 0.0
    g = torch.Generator().manual_seed(seed)
    logs = []
    with torch.no_grad():
        for r in rows:
            x = torch.randn(r, linear.in_features, generator=g).to(w.dtype)
            try:
                y_ref = F.linear(x, w, b)
                y = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
            except RuntimeError:
                return False, 0.0
            if not torch.equal(y, y_ref):
                return False, 0.0
            t_ref, t_pk = [], []
            for _ in range(2):  # alternate A/B
                t_ref.append(_median_time(lambda x=x: F.linear(x, w, b), reps))
                t_pk.append(_median_time(lambda x=x: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], ""),
                                         reps))
            logs.append(torch.tensor(min(t_ref) / min(t_pk)).log())
    return True, float(torch.stack(logs).mean().exp())


def _targets(model: nn.Module, lm_head: bool):
    """``(parent, attr, name, module)`` of each plain nn.Linear in the decoder layers (and lm_head)."""
    out = []
    for pname, parent in model.named_modules():
        for attr, child in parent.named_children():
            if type(child) is not nn.Linear:
                continue
            name = f"{pname}.{attr}" if pname else attr
            in_layers = ".layers." in f".{name}"
            if in_layers or (lm_head and attr == "lm_head"):
                out.append((parent, attr, name, child))
    return out


def prepack_linears(model: nn.Module, *, lm_head: bool = True, min_speedup: float = 1.03,
                    rows=(1, 16, 64)) -> int:
    """Replace the decoder layers' ``nn.Linear`` modules (and ``lm_head`` if ``lm_head``) by
    :class:`PackedLinear` where, for their weight's shape and dtype, the packed oneDNN call gives equal
    results and is at least ``min_speedup`` times faster (see :func:`calibrate`). CPU models only.

    Returns:
        The number of modules replaced (0 when oneDNN is unavailable, the model is not on the CPU, or
        no shape qualifies).
    """
    if not available():
        return 0
    targets = _targets(model, lm_head)
    if not targets or any(m.weight.device.type != "cpu" for *_, m in targets):
        return 0
    n = 0
    for parent, attr, _name, lin in targets:
        key = (lin.out_features, lin.in_features, lin.weight.dtype, lin.bias is not None, tuple(rows))
        if key not in _VERDICTS:
            _VERDICTS[key] = calibrate(lin, rows=rows)
            _log.debug("prepack %s %s: equal=%s speedup=%.2f", tuple(key[:2]), key[2], *_VERDICTS[key])
        equal, speedup = _VERDICTS[key]
        if equal and speedup >= min_speedup:
            setattr(parent, attr, PackedLinear(lin))
            n += 1
    return n
