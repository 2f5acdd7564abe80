"""``PipelineConfig``: where the trainer is cut and what crosses each cut (a recipe's ``pipeline:``).

A plain dataclass, so ``OmegaConf.structured(PipelineConfig)`` types a recipe section and
``PipelineConfig(**section)`` builds one in code.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tclightning.codecs import CODECS, FIRST_FITS, QUANT_BITS
from tclightning.codecs.base import WIRE_DTYPES
from tclightning.errors import TclightningError
from tclightning.settings import (
    Problem,
    field_problems,
    flag,
    grouped,
    integer,
    list_of,
    moved_keys,
    number,
    one_of,
    options_of,
    positive,
    setting,
)

LAYOUTS = ("dense", "all", "shallow", "shallow:n", "solo:i", "explicit")
"""``pipeline.layout``: which cuts are compressed (``solo:i`` is ``solo:0``, ``solo:1``, ...;
``shallow:n`` is ``shallow:2``, ...; ``shallow`` is ``shallow:1``)."""

SCHEDULES = ("gpipe", "1f1b")
"""``pipeline.schedule``: the multi-process pipeline schedule."""

STATELESS_CODECS = ("prf", "identity")
"""Codecs whose receiver learns nothing from the tokens it sees (replicas may split them)."""


def _layout(value: Any) -> str | None:
    """A layout of :data:`LAYOUTS`: ``solo:`` followed by a cut index, ``shallow:`` by a count of cuts."""
    if value in LAYOUTS and value not in ("solo:i", "shallow:n"):
        return None
    if isinstance(value, str) and value.startswith("solo:"):
        return None if value[5:].lstrip("-").isdigit() else f"expected solo:<cut index>, e.g. solo:0, got {value!r}"
    if isinstance(value, str) and value.startswith("shallow:"):
        count = value[8:]
        return None if count.isdigit() and int(count) >= 1 else f"expected shallow:<count >= 1>, e.g. shallow:2, got {value!r}"
    return f"expected one of {', '.join(LAYOUTS)}, got {value!r}"


def _bits(value: Any) -> str | None:
    """``pipeline.bits``: one of :data:`~tclightning.codecs.QUANT_BITS`, or null."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value in QUANT_BITS):
        return None
    return f"expected one of {', '.join(map(str, QUANT_BITS))} or null, got {value!r}"


@dataclass
class BasisOptions:
    """``pipeline.basis``: how the ``lowrank`` codec fits and keeps its basis (docs/codecs.md)."""

    refresh_every: int = setting(
        10, integer(0),
        "steps between basis refresh checks (0 = keep the first fit). A check is free when the anchor's "
        "dense pass fed both sides since the last one; otherwise the sender decides and sends a 4-byte flag, plus "
        "the basis, ``(d r + d) * 4`` bytes (and any token centres), if it refits (all counted in ``wire/bytes_fwd``)")
    first_fit: str = setting(
        "dense", one_of(FIRST_FITS),
        "how the first basis is made. ``dense``: the first step crosses the dense boundary and both "
        "sides fit on it (nothing else sent). ``ship``: the sender fits on the first batch it encodes and ships "
        "the basis and token centres, ``(d r + d + n (d + 1)) * 4`` bytes once (counted in ``wire/bytes_fwd``), so "
        "no step crosses dense; across processes the first batch's payloads also cross once so that each "
        "later cut fits on what it will receive. Pays when a dense step costs more than a basis (a short run)")
    refresh_tolerance: float = setting(
        0.02, number(0.0, 1.0),
        "refit only when a fresh fit would lose at least this share less of the recent tokens' energy "
        "than the current basis (0 = refit at every check)")
    tokens: int = setting(
        1024, integer(0),
        "how many token ids get their own centre (the most frequent in the tokens a fit sees). Every "
        "stage holds the batch's token ids, so both sides centre each token on its id's mean and fit the basis to "
        "the within-token covariance: zero bytes per token; a shipped refit adds ``n (d + 1) * 4`` bytes for the "
        "table. 0: one mean for all tokens")


@dataclass
class PipelineConfig:
    """Cut layout and codecs: each key with its range and help (:func:`tclightning.settings.setting`)."""

    layout: str = setting(
        "dense", _layout,
        "which cuts are compressed: ``dense`` (none), ``all``, ``shallow:n`` (the first n cuts; ``shallow`` is "
        "``shallow:1``), ``solo:i`` (only cut i, 0-based in cut order), ``explicit`` (``cut_codecs``, one per cut). Uncompressed "
        "cuts send the dense boundary")
    stages: int = setting(
        4, positive(1024),
        "pipeline stages when ``cuts`` is not given: an even split of the decoder layers into ``stages`` blocks, cut "
        "after layer ``round(n * i / stages) - 1`` for i = 1..stages-1 (28 layers, 4 stages -> cuts after layers 6, "
        "13, 20)")
    cuts: list[int] | None = setting(
        None, list_of(integer(0), optional=True),
        "explicit cut layers (0-based layer index the cut follows), strictly increasing, each in [0, n_layers - 2]. "
        "Overrides ``stages``")
    cut_codecs: list[str] | None = setting(
        None, list_of(one_of(CODECS), optional=True),
        "``explicit`` layout: one forward codec name per cut (``identity`` = dense); overrides ``codec``")
    codec: str = setting(
        "prf", one_of(CODECS),
        f"forward codec at compressed cuts: {' | '.join(CODECS)}. The gradient message is the gradient w.r.t. the "
        "forward payload (the same [tokens, k] indices for prf, free). ``prf`` keeps k channels (the others are "
        "zero at the receiver); ``svd`` / ``lowrank`` send k basis coefficients (rank = the budget k: equal bytes "
        "per token; ``lowrank`` with ``bits``: more, quantised coefficients in the same bytes)")
    rate: float = setting(0.05, number(0.0, 1.0, low_open=True),
                          "budget as a share of the d channels: ``k = round(rate * d)`` (0.05 -> 77 of 1536)")
    k: int | None = setting(None, positive(optional=True), "budget in values per token; overrides ``rate``")
    payload_dtype: str | None = setting(
        None, one_of(WIRE_DTYPES, optional=True),
        "the dtype compressed cuts' messages cross in: ``float16`` | ``bfloat16`` | null (the activations' dtype). "
        "On a float32 model a 16-bit payload halves the bytes per value, so a basis codec can send twice the "
        "coefficients at the same bytes (``rate=0.04, payload_dtype=bfloat16`` costs what ``rate=0.02`` does in "
        "float32). The gradient message crosses in it too, which is why bfloat16 (float32's range) is the safer "
        "choice: gradient values often lie below float16's smallest normal number")
    bits: int | None = setting(
        None, _bits,
        "``lowrank``: bits per basis coefficient, fixed-length in place of ``entropy_coding``, ``8`` | ``4`` | ``3`` | "
        "``2`` | null (entropy-coded, or float with ``entropy_coding: false``). The "
        "bytes k values cost in the payload dtype (float32 unless ``payload_dtype``) buy ``r = floor((8 * bytes - "
        "16) / bits)`` coefficients (at most d) and a 16-bit scale per token, ``ceil(r * bits / 8) + 2`` bytes "
        "per token each way: round to nearest going forward, unbiased stochastic rounding (keyed) for the "
        "gradient message")
    bits_lead: bool = setting(
        False, flag,
        "``lowrank`` with ``bits``: the first coefficient (the basis's leading direction) crosses in 16 bits "
        "(float16 forward, bfloat16 backward) beside the quantised rest, which get their own scale, so one "
        "dominant direction (SmolLM2's massive-activation channel) does not set every coefficient's step: "
        "``r = 1 + floor((8 * bytes - 32) / bits)``, ``ceil((r - 1) * bits / 8) + 4`` bytes per token")
    entropy_coding: bool = setting(
        True, flag,
        "``lowrank`` without ``bits``: entropy-coded coefficients (false: float coefficients; other codecs ignore "
        "the key). The bytes k values cost in the payload dtype (float32 unless "
        "``payload_dtype``) are each row's budget per token; the basis keeps ``min(d, 8 x bytes)`` directions, "
        "quantised with one step per row (the smallest that fits, carried in 4 bytes) and ANS-coded under a "
        "Laplace model of each direction's variance (the fit's eigenvalues, which both sides hold), so the bytes go "
        "to the leading directions by themselves. The gradient message: unbiased stochastic rounding, one step "
        "and scale per row (8 bytes), the same budget. Exactly the budget is counted. The first fit waits for "
        "8 x d dense tokens")
    basis: dict[str, Any] = grouped(
        BasisOptions, "``lowrank`` only: how the basis is fitted and kept, e.g. {refresh_every: 1, tokens: 0}")
    microbatches: int = setting(
        4, positive(),
        "multi-process mode (``trainer.devices`` x ``num_nodes`` > 1): micro-batches per pipelined forward/backward "
        "(capped at the batch's rows)")
    schedule: str = setting(
        "gpipe", one_of(SCHEDULES),
        "multi-process mode: ``gpipe`` (all forwards, then all backwards) | ``1f1b``")
    timeout_s: float = setting(
        300.0, number(0.0, 10**7, low_open=True),
        "multi-process mode: seconds a rank waits for a peer before stopping with an error naming it (the process "
        "group's timeout; at most 10^7, about 116 days)")
    replicas: int = setting(
        1, positive(1024),
        "multi-process mode: copies of each stage (data parallel over replicas of the pipeline). ``trainer.devices x "
        "trainer.num_nodes`` must be ``stages x replicas``; each replica trains on its share of every minibatch and "
        "a stage's gradients are summed over its replicas. Needs stateless codecs (``prf``, or dense cuts): a "
        "replica's receiver sees only its share of the tokens")

    tied_rows: bool = setting(
        False, flag,
        "multi-process mode, tied input/output embeddings: the last stage owns the tied weight (its optimizer "
        "state and step). Before a pass the last rank sends the first the rows of the batch's distinct token ids "
        "(unless the first holds the current weight, as after a dense weight sync), and after a backward the first "
        "sends back only those rows' gradient: at most ``2 x ids x d x 4`` bytes a tick instead of the dense "
        "gradient sum's ``2 x vocabulary x d x 4``. The weight sync to rank 0 carries the tied weight from the last "
        "stage. false: both ranks sum the dense gradient and step their copy")

    @property
    def basis_options(self) -> BasisOptions:
        """``basis`` as :class:`BasisOptions` (the options it leaves out at their defaults)."""
        return options_of(BasisOptions, self.basis)

    @property
    def refresh_every(self) -> int:
        return self.basis_options.refresh_every

    @property
    def first_fit(self) -> str:
        return self.basis_options.first_fit

    @property
    def refresh_tolerance(self) -> float:
        return self.basis_options.refresh_tolerance

    @property
    def basis_tokens(self) -> int:
        return self.basis_options.tokens

    seed: ClassVar[int] = 0
    """PRF key seed shared by sender and receiver (never sent; a constant: each step and cut already
    key their own draws, so a second seed adds nothing; not a recipe key)."""

    def problems(self) -> Iterator[Problem]:
        """What no one field says alone and the model does not decide (a recipe runs these as a cross
        check with ``trainer.strategy: pipeline``; the cut count is :mod:`~tclightning.pipeline.layout`'s)."""
        if self.layout == "explicit" and self.cut_codecs is None:
            yield Problem(("pipeline.layout", "pipeline.cut_codecs"),
                          "pipeline.layout 'explicit' needs cut_codecs (one codec per cut; identity = dense)")
        if self.layout != "explicit" and self.cut_codecs is not None:
            yield Problem(("pipeline.cut_codecs", "pipeline.layout"),
                          "pipeline.cut_codecs is only read by layout 'explicit'")
        if self.bits is not None:
            used = set(self.cut_codecs) - {"identity"} if self.cut_codecs is not None else {self.codec}
            others = sorted(used - {"lowrank"})
            if others:
                yield Problem(("pipeline.bits", "pipeline.codec", "pipeline.cut_codecs"),
                              f"pipeline.bits={self.bits} quantises basis coefficients: only codec 'lowrank' takes "
                              f"it, not '{others[0]}' (set pipeline.codec=lowrank or pipeline.bits=null)")
        if self.bits_lead and self.bits is None:
            yield Problem(("pipeline.bits_lead", "pipeline.bits"),
                          "pipeline.bits_lead sends the leading coefficient beside quantised ones: it needs pipeline.bits")
        if self.replicas > 1 and self.layout != "dense":
            # each replica's receiver would learn from its own share of the tokens: bases would
            # drift apart between replicas (and from one process)
            used = set(self.cut_codecs) if self.cut_codecs is not None else {self.codec}
            stateful = sorted(used - set(STATELESS_CODECS))
            if stateful:
                yield Problem(
                    ("pipeline.replicas", "pipeline.codec", "pipeline.cut_codecs"),
                    f"pipeline.replicas={self.replicas} needs stateless codecs, but codec '{stateful[0]}' learns "
                    "from the tokens a receiver sees (each replica sees only its share): use pipeline.codec=prf, "
                    "or pipeline.replicas=1")

        if self.tied_rows and self.replicas > 1:
            yield Problem(("pipeline.tied_rows", "pipeline.replicas"),
                          f"pipeline.tied_rows is not built for replicated pipelines (pipeline.replicas={self.replicas}): "
                          "set pipeline.tied_rows=false or pipeline.replicas=1")

    def validate(self) -> None:
        """For a config built in Python (a recipe's loader checks the same): every field in its
        range, then :meth:`problems`; raises ``TclightningError`` naming the key."""
        for problem in field_problems(self, "pipeline"):
            raise TclightningError(f"{problem.keys[0]}: {problem.message}")
        for problem in self.problems():
            raise TclightningError(problem.message)


MOVED_KEYS: dict[str, str] = {
    "refresh_every": "basis.refresh_every",
    "first_fit": "basis.first_fit",
    "refresh_tolerance": "basis.refresh_tolerance",
    "basis_tokens": "basis.tokens",
}
"""Keys of the ``pipeline`` section an earlier version read, and the option of ``basis`` that holds each now."""


def upgrade(section: Mapping[str, Any]) -> dict[str, Any]:
    """A ``pipeline`` section as an earlier version recorded it, in today's keys (a ``shallow``
    layout's ``shallow_count`` is the layout's count, ``shallow:n``)."""
    out = moved_keys(section, MOVED_KEYS)
    count = out.pop("shallow_count", 1)
    if out.get("layout") == "shallow" and count != 1:
        out["layout"] = f"shallow:{count}"
    return out


RETIRED_KEYS = ("compressed", "rank", "rescale", "seed")
"""Keys of the ``pipeline`` section an earlier version's run record holds that no option reads now:
``compressed`` said what ``cut_codecs`` says (``[true, false]`` is ``[<codec>, identity]``); ``rank``
is the budget k (equal bytes per token, the only rank measured); ``rescale`` (PRF's unbiased
``d/k`` scaling) was never measured in a run; ``seed`` is the constant :attr:`PipelineConfig.seed`."""

REPLACED_BY: dict[str, str] = {"seed": "the PRF key is fixed (each step and cut key their own draws)",
                               "shallow_count": "set pipeline.layout=shallow:<count> (shallow is shallow:1)"}
"""What a recipe that sets a retired key is pointed to."""
