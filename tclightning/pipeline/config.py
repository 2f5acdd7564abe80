"""``PipelineConfig``: where the trainer is cut and what crosses each cut (a recipe's ``pipeline:``).

A plain dataclass, so ``OmegaConf.structured(PipelineConfig)`` types a recipe section and
``PipelineConfig(**section)`` builds one in code.
"""

from __future__ import annotations

from dataclasses import dataclass

from tclightning.codecs import BASIS_CODECS, CODECS, FILLS
from tclightning.codecs.base import WIRE_DTYPES
from tclightning.errors import TclightningError

LAYOUTS = ("dense", "all", "shallow", "solo:i", "explicit")


@dataclass
class PipelineConfig:
    """Cut layout and codecs; each field is documented by the string below it."""

    layout: str = "dense"
    """Which cuts are compressed: ``dense`` (none), ``all``, ``shallow`` (the first
    ``shallow_count`` cuts), ``solo:i`` (only cut i, 0-based in cut order), ``explicit``
    (``compressed`` / ``cut_codecs`` per cut). Uncompressed cuts send the dense boundary."""

    stages: int = 4
    """Pipeline stages when ``cuts`` is not given: an even split of the decoder layers into
    ``stages`` blocks, cut after layer ``round(n * i / stages) - 1`` for i = 1..stages-1
    (28 layers, 4 stages -> cuts after layers 6, 13, 20)."""

    cuts: list[int] | None = None
    """Explicit cut layers (0-based layer index the cut follows), strictly increasing, each in
    [0, n_layers - 2]. Overrides ``stages``."""

    compressed: list[bool] | None = None
    """``explicit`` layout: one flag per cut (True = apply ``codec``, False = dense)."""

    cut_codecs: list[str] | None = None
    """``explicit`` layout: one forward codec name per cut (``identity`` = dense); overrides
    ``compressed`` and ``codec``."""

    shallow_count: int = 1
    """``shallow`` layout: how many of the shallowest cuts are compressed."""

    codec: str = "prf"
    """Forward codec at compressed cuts: ``prf`` | ``lowrank`` | ``hybrid`` | ``svd`` | ``identity``."""

    backward_codec: str | None = None
    """Gradient codec at compressed cuts. None: the gradient w.r.t. the forward payload (same
    [tokens, k] indices for prf, free); or ``identity`` (dense straight-through), ``prf``
    (independent indices), ``powersgd``."""

    rate: float = 0.05
    """Budget as a share of the d channels: ``k = round(rate * d)`` (0.05 -> 77 of 1536)."""

    k: int | None = None
    """Budget in values per token; overrides ``rate``."""

    fill: str = "zero"
    """PRF receiver fill for the d - k dropped channels: ``zero`` | ``mean`` (per-channel running
    mean of decoded values, updated once per step of the PRF key) | ``conditional`` (Gaussian
    conditional mean given the kept channels, rank-``fill_rank`` PPCA fitted to the decoded values; the
    per-channel mean until the statistics are warm; not with ``rescale``)."""

    fill_rank: int = 16
    """``conditional`` fill: rank r of the PPCA model of the activations (at most d; d - 1 is the
    exact Gaussian conditional mean, one k x k solve per token instead of r x r)."""

    fill_tokens: int = 1024
    """``conditional`` fill: how many distinct token ids get their own mean (in order of first sight).
    Every stage holds the batch's token ids, so the fill centres each token on its id's mean
    (``x | token ~ N(mu_token, Sigma_within)``); other ids use the global mean. 0: one mean for all."""

    fill_pairs: int = 4096
    """``conditional`` fill: how many distinct pairs (a token and the one before it) get their own
    mean, shrunk towards the token's (in order of first sight; other pairs use the token's mean).
    0: token means only. Receiver memory: two ``[fill_pairs, d]`` float64 tables."""

    fill_momentum: float = 0.1
    """EMA weight of the newest tick in the ``mean`` fill (``conditional``: its moments decay by
    1 - fill_momentum per step)."""

    rescale: bool = False
    """PRF: scale kept deviations from the fill by d/k (unbiased random-k; larger variance)."""

    payload_dtype: str | None = None
    """The dtype compressed cuts' messages cross in: ``float16`` | ``bfloat16`` | null (the
    activations' dtype). On a float32 model a 16-bit payload halves the bytes per value, so a basis
    codec can send twice the coefficients at the same bytes (``rate=0.04, payload_dtype=bfloat16``
    costs what ``rate=0.02`` does in float32). The gradient message crosses in it too, which is why
    bfloat16 (float32's range) is the safer choice: gradient values often lie below float16's
    smallest normal number."""

    rank: int | None = None
    """Basis rank r for ``svd`` / ``lowrank`` / ``powersgd`` (None = the budget k: equal bytes per
    token) and ``hybrid`` (None = k // 2; the other k - r values are residual coordinates)."""

    refresh_every: int = 10
    """``lowrank`` / ``hybrid``: steps between basis refresh checks (0 = keep the first fit). A check
    is free when the anchor's dense pass fed both sides since the last one; otherwise the sender
    decides and sends a 4-byte flag, plus the basis, ``(d r + d) * 4`` bytes (and any token
    centres), if it refits (all counted in ``wire/bytes_fwd``)."""

    refresh_tolerance: float = 0.02
    """``lowrank`` / ``hybrid``: refit only when a fresh fit would lose at least this share less
    of the recent tokens' energy than the current basis (0 = refit at every check)."""

    basis_tokens: int = 1024
    """``lowrank`` / ``hybrid``: how many token ids get their own centre (the most frequent in the
    tokens a fit sees). Every stage holds the batch's token ids, so both sides centre each token
    on its id's mean and fit the basis to the within-token covariance: zero bytes per token; a
    shipped refit adds ``n (d + 1) * 4`` bytes for the table. 0: one mean for all tokens."""

    seed: int = 0
    """PRF key seed shared by sender and receiver (never sent)."""

    microbatches: int = 4
    """Multi-process mode (``trainer.devices`` x ``num_nodes`` > 1): micro-batches per pipelined
    forward/backward (capped at the batch's rows)."""

    schedule: str = "gpipe"
    """Multi-process mode: ``gpipe`` (all forwards, then all backwards) | ``1f1b``."""

    timeout_s: float = 300.0
    """Multi-process mode: seconds a rank waits for a peer before stopping with an error naming it
    (the process group's timeout)."""

    replicas: int = 1
    """Multi-process mode: copies of each stage (data parallel over replicas of the pipeline).
    ``trainer.devices x trainer.num_nodes`` must be ``stages x replicas``; each replica trains on
    its share of every minibatch and a stage's gradients are summed over its replicas. Needs
    stateless codecs (``prf`` with ``fill: zero``, or dense cuts): a replica's receiver sees only
    its share of the tokens."""

    def validate(self) -> None:
        """Check names and ranges that do not depend on the model; raises ``TclightningError``."""
        layout = self.layout
        if not (layout in ("dense", "all", "shallow", "explicit") or layout.startswith("solo:")):
            raise TclightningError(f"pipeline.layout '{layout}' is not one of {', '.join(LAYOUTS)}")
        if layout.startswith("solo:") and not layout[5:].lstrip("-").isdigit():
            raise TclightningError(f"pipeline.layout '{layout}': expected solo:<cut index>, e.g. solo:0")
        if self.cuts is None and self.stages < 1:
            raise TclightningError(f"pipeline.stages must be >= 1, got {self.stages}")
        if layout == "explicit" and self.compressed is None and self.cut_codecs is None:
            raise TclightningError("pipeline.layout 'explicit' needs 'compressed' or 'cut_codecs' (one entry per cut)")
        if layout != "explicit" and (self.compressed is not None or self.cut_codecs is not None):
            raise TclightningError("pipeline.compressed / cut_codecs are only read by layout 'explicit'")
        if self.shallow_count < 1:
            raise TclightningError(f"pipeline.shallow_count must be >= 1, got {self.shallow_count}")
        forward_codecs = [self.codec, *(self.cut_codecs or [])]
        for name in forward_codecs:
            if name not in CODECS:
                raise TclightningError(f"pipeline codec '{name}' is not one of {', '.join(CODECS)}")
            if name == "powersgd":
                raise TclightningError("pipeline codec 'powersgd' compresses gradients only: use it as backward_codec")
        if self.backward_codec in BASIS_CODECS:
            raise TclightningError(
                f"pipeline.backward_codec '{self.backward_codec}' is an activation codec; its gradient message "
                "is already r values per token (leave backward_codec unset)"
            )
        if not 0.0 <= self.refresh_tolerance <= 1.0:
            raise TclightningError(f"pipeline.refresh_tolerance must be in [0, 1], got {self.refresh_tolerance}")
        if self.refresh_every < 0:
            raise TclightningError(f"pipeline.refresh_every must be >= 0 (0 = never refit), got {self.refresh_every}")
        if self.backward_codec is not None and self.backward_codec not in CODECS + ("svd",):
            raise TclightningError(f"pipeline.backward_codec '{self.backward_codec}' is not one of {', '.join(CODECS)}")
        if self.backward_codec == "svd":
            raise TclightningError(
                "pipeline.backward_codec 'svd' is not supported (static bases fit activations); use powersgd"
            )
        if self.fill not in FILLS:
            raise TclightningError(f"pipeline.fill '{self.fill}' is not one of {', '.join(FILLS)}")
        if self.fill == "conditional" and self.rescale:
            raise TclightningError(
                "pipeline.fill 'conditional' does not combine with pipeline.rescale (set rescale: false)"
            )
        if not 0.0 < self.rate <= 1.0:
            raise TclightningError(f"pipeline.rate must be in (0, 1], got {self.rate}")
        if self.k is not None and self.k < 1:
            raise TclightningError(f"pipeline.k must be >= 1, got {self.k}")
        if self.rank is not None and self.rank < 1:
            raise TclightningError(f"pipeline.rank must be >= 1, got {self.rank}")
        if self.microbatches < 1:
            raise TclightningError(f"pipeline.microbatches must be >= 1, got {self.microbatches}")
        if self.schedule not in ("gpipe", "1f1b"):
            raise TclightningError(f"pipeline.schedule '{self.schedule}' is not one of gpipe, 1f1b")
        if self.timeout_s <= 0:
            raise TclightningError(f"pipeline.timeout_s must be > 0, got {self.timeout_s}")
        if self.fill_rank < 1:
            raise TclightningError(f"pipeline.fill_rank must be >= 1, got {self.fill_rank}")
        if self.basis_tokens < 0:
            raise TclightningError(f"pipeline.basis_tokens must be >= 0, got {self.basis_tokens}")
        if self.fill_tokens < 0:
            raise TclightningError(f"pipeline.fill_tokens must be >= 0, got {self.fill_tokens}")
        if self.fill_pairs < 0:
            raise TclightningError(f"pipeline.fill_pairs must be >= 0, got {self.fill_pairs}")
        if self.payload_dtype is not None and self.payload_dtype not in WIRE_DTYPES:
            raise TclightningError(f"pipeline.payload_dtype must be one of {', '.join(WIRE_DTYPES)} or null, "
                                   f"got {self.payload_dtype!r}")
        if not 0.0 < self.fill_momentum <= 1.0:
            raise TclightningError(f"pipeline.fill_momentum must be in (0, 1], got {self.fill_momentum}")
        if self.replicas < 1:
            raise TclightningError(f"pipeline.replicas must be >= 1, got {self.replicas}")
        if self.replicas > 1 and layout != "dense":
            # each replica's receiver would learn from its own share of the tokens: fills and
            # bases would drift apart between replicas (and from one process)
            used = set(self.cut_codecs) if self.cut_codecs is not None else {self.codec}
            stateful = sorted(used - {"prf", "identity"})
            if stateful or ("prf" in used and self.fill != "zero"):
                what = f"codec '{stateful[0]}'" if stateful else f"pipeline.fill '{self.fill}'"
                raise TclightningError(
                    f"pipeline.replicas={self.replicas} needs stateless codecs, but {what} learns from the tokens "
                    "a receiver sees (each replica sees only its share): use pipeline.codec=prf with "
                    "pipeline.fill=zero, or pipeline.replicas=1"
                )
