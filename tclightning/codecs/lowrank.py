"""Low-rank codecs, the comparison point for PRF at equal budget (rank r = k values per token).

* ``svd`` (activations): a static rank-r basis ``U`` [d, r] and mean ``mu`` from calibration
  activations at the cut. ``payload = (x - mu) U`` ([B, L, r]), ``x_hat = mu + payload U^T``.
  Linear, so the gradient w.r.t. the payload ``g U`` is the [B, L, r] backward message.
* ``powersgd`` (gradients only): one PowerSGD power iteration per message on the gradient matrix
  ``M`` [N, d]: ``P = orth(M Q)``, ``Q <- M^T P``, ``payload = (P, Q)``, ``M_hat = P Q^T``; Q is
  warm-started from the previous message (sender-side state).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tclightning.codecs.base import Codec, CodecKey, as_rows
from tclightning.codecs.prf import fold32, mix32


class SVDCodec(Codec):
    """Static rank-r projection: ``r * element_size`` bytes per token, plus the basis once.

    Calibrate with :meth:`calibrate` (centred PCA of calibration activations, via the d x d
    covariance in float64); an uncalibrated codec calibrates on the first tensor it encodes.
    ``setup_bytes`` is the one-off cost of shipping ``U`` and ``mu`` to the receiver.
    """

    name = "svd"

    def __init__(self, dim: int, rank: int) -> None:
        super().__init__(dim)
        if not 1 <= rank <= dim:
            raise ValueError(f"rank must be in [1, d={dim}], got {rank}")
        self.rank = rank
        self.basis: Tensor | None = None  # [d, r] float32, orthonormal columns
        self.mean: Tensor | None = None  # [d] float32
        self.energy_kept: float | None = None  # share of centred variance the basis keeps

    @property
    def calibrated(self) -> bool:
        return self.basis is not None

    @torch.no_grad()
    def calibrate(self, activations: Tensor) -> None:
        """Fit ``mu`` and the top-r principal directions of ``activations`` ([..., d] tokens)."""
        tokens = activations.detach().reshape(-1, self.dim).double()
        if tokens.shape[0] < 2:
            raise ValueError("svd calibration needs at least 2 tokens")
        mean = tokens.mean(0)
        centred = tokens - mean
        covariance = centred.T @ centred / tokens.shape[0]
        eigenvalues, eigenvectors = torch.linalg.eigh(covariance)  # ascending
        top = eigenvectors[:, -self.rank :].flip(-1)
        # fix each direction's sign (largest |entry| positive) so the basis is reproducible
        pivots = top.abs().argmax(0)
        top = top * torch.sign(top[pivots, torch.arange(self.rank, device=top.device)])
        total = eigenvalues.clamp_min(0).sum()
        self.energy_kept = float(eigenvalues[-self.rank :].clamp_min(0).sum() / total) if total > 0 else 1.0
        self.basis, self.mean = top.float(), mean.float()

    def setup_bytes(self, dtype: torch.dtype) -> int:
        """One-off bytes to ship the basis and mean: ``(d * r + d) * element_size``."""
        return (self.dim * self.rank + self.dim) * dtype.itemsize

    def encode(self, x: Tensor, key: CodecKey) -> Tensor:
        if not self.calibrated:
            self.calibrate(x)
        assert self.basis is not None and self.mean is not None
        basis, mean = self.basis.to(x.device, x.dtype), self.mean.to(x.device, x.dtype)
        return (x - mean) @ basis

    def decode(self, payload: Tensor, key: CodecKey, *, token_mask: Tensor | None = None) -> Tensor:  # type: ignore[override]
        if not self.calibrated:
            raise RuntimeError("svd codec: decode before calibration")
        assert self.basis is not None and self.mean is not None
        basis, mean = self.basis.to(payload.device, payload.dtype), self.mean.to(payload.device, payload.dtype)
        return mean + payload @ basis.T

    def payload_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        return tokens * self.rank * dtype.itemsize

    def state_dict(self) -> dict[str, Any]:
        if self.basis is None:
            return {}
        return {"basis": self.basis.cpu(), "mean": self.mean.cpu(), "energy_kept": self.energy_kept}  # type: ignore[union-attr]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.basis, self.mean, self.energy_kept = state["basis"], state["mean"], state.get("energy_kept")

    def __repr__(self) -> str:
        return f"SVDCodec(dim={self.dim}, rank={self.rank})"


class PowerSGDCodec(Codec):
    """Rank-r PowerSGD for gradient messages; ``(N * r + d * r) * element_size`` bytes per message.

    Not differentiable (QR inside), so it is only valid as a separate backward codec.
    """

    name = "powersgd"
    differentiable = False

    def __init__(self, dim: int, rank: int) -> None:
        super().__init__(dim)
        if not 1 <= rank <= dim:
            raise ValueError(f"rank must be in [1, d={dim}], got {rank}")
        self.rank = rank
        self._q: Tensor | None = None  # [d, r] float32 warm start

    def _initial_q(self, key: CodecKey, device: torch.device) -> Tensor:
        generator = torch.Generator().manual_seed(mix32(fold32(key.seed) ^ fold32(key.cut)))
        return torch.randn(self.dim, self.rank, generator=generator).to(device)

    @torch.no_grad()
    def encode(self, x: Tensor, key: CodecKey) -> tuple[Tensor, Tensor]:
        matrix = as_rows(x).reshape(-1, self.dim).float()
        q = self._q if self._q is not None and self._q.device == matrix.device else self._initial_q(key, matrix.device)
        p, _ = torch.linalg.qr(matrix @ q)
        q = matrix.T @ p
        if q.shape[1] == self.rank:  # fewer tokens than r gives a thinner factor: don't warm-start from it
            self._q = q
        return p.to(x.dtype), q.to(x.dtype)

    def decode(self, payload: tuple[Tensor, Tensor], key: CodecKey, *, token_mask: Tensor | None = None) -> Tensor:  # type: ignore[override]
        """``P Q^T`` as ``[N, d]``; the caller reshapes to the gradient's shape."""
        p, q = payload
        return p @ q.T

    def payload_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        rank = min(self.rank, max(tokens, 1))
        return (tokens * rank + self.dim * rank) * dtype.itemsize

    def payload_bytes_per_token(self, dtype: torch.dtype) -> float:
        """``r * element_size``: the per-message ``Q`` is amortised over many tokens."""
        return float(self.rank * dtype.itemsize)

    def state_dict(self) -> dict[str, Any]:
        return {} if self._q is None else {"q": self._q.cpu()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self._q = state["q"]

    def __repr__(self) -> str:
        return f"PowerSGDCodec(dim={self.dim}, rank={self.rank})"
