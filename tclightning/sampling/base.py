"""The sampler interface: prompts in, completions with per-token log-probs out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tclightning.errors import TclightningError
from tclightning.limits import waited_on
from tclightning.processes import child_environment


class NonFiniteError(TclightningError):
    """The policy diverged: its weights, or the logits it gives, hold NaN or Inf.

    Raised before anything is sampled from such a policy (never a traceback inside
    ``generate``). The CLI prints it as one line and exits 3: a diverged run, not a bad input.
    """

    exit_code = 3


def nonfinite_parameters(model: torch.nn.Module) -> list[str]:
    """Names of the parameters of ``model`` holding NaN or Inf (empty when all are finite).

    One max-abs norm per parameter and a single host sync: cheap next to a forward pass, and a
    max (unlike a sum of squares) does not overflow on large finite weights.
    """
    named = list(model.named_parameters())
    if not named:
        return []
    norms = [torch.linalg.vector_norm(p.detach(), ord=float("inf")).float() for _, p in named]
    finite = torch.isfinite(torch.stack([n.to(norms[0].device) for n in norms]))
    if bool(finite.all()):
        return []
    return [name for (name, _), ok in zip(named, finite.tolist()) if not ok]


TENSOR_FIELDS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logp_sampler", "truncated")
"""The tensor fields of :class:`Rollouts` (what :meth:`Rollouts.to` moves)."""


@dataclass
class Rollouts:
    """A batch of ``B = prompts x group_size`` completions, rows of one prompt contiguous.

    Token layout (what the trainer recomputes over): ``[left-padded prompt | right-padded
    completion]``. ``completion_mask`` is 1 for generated tokens up to and including the first
    eos; ``logp_sampler`` is 0 where the mask is 0.
    """

    prompt_ids: torch.Tensor  # [B, Lp] long, left padded
    prompt_mask: torch.Tensor  # [B, Lp] long
    completion_ids: torch.Tensor  # [B, Lc] long, right padded
    completion_mask: torch.Tensor  # [B, Lc] float
    logp_sampler: torch.Tensor  # [B, Lc] float32
    texts: list[str]  # decoded completions (special tokens stripped)
    truncated: torch.Tensor  # [B] bool: hit max_new_tokens without eos
    group_size: int

    @property
    def num_sequences(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask.long()], dim=1)

    @property
    def position_ids(self) -> torch.Tensor:
        """Positions counted over real tokens only, as HF ``generate`` does for left padding."""
        mask = self.attention_mask
        return (mask.cumsum(-1) - 1).clamp(min=0)

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)

    def to(self, device: torch.device | str) -> Rollouts:
        """The same batch with every tensor on ``device`` (a new ``Rollouts``; ``texts`` shared)."""
        return replace(self, **{name: getattr(self, name).to(device) for name in TENSOR_FIELDS})

    def select(self, rows: torch.Tensor) -> Rollouts:
        """The sub-batch of ``rows`` (a 1-D index tensor), trimmed to its longest completion."""
        mask = self.completion_mask[rows]
        width = max(int(mask.sum(-1).max().item()) if len(rows) else 0, 1)
        return Rollouts(
            prompt_ids=self.prompt_ids[rows],
            prompt_mask=self.prompt_mask[rows],
            completion_ids=self.completion_ids[rows, :width],
            completion_mask=mask[:, :width],
            logp_sampler=self.logp_sampler[rows, :width],
            texts=[self.texts[i] for i in rows.tolist()],
            truncated=self.truncated[rows],
            group_size=self.group_size,
        )


class Sampler(Protocol):
    """Generates ``group_size`` completions per prompt with the *dense* (uncompressed) policy."""

    def generate(
        self,
        model: PreTrainedModel,
        prompts: Sequence[str],  # task prompts (user text); the sampler's formatter renders them
        *,
        group_size: int,
        seed: int,
        greedy: bool = False,
        max_new_tokens: int | None = None,
    ) -> Rollouts: ...


TEMPLATE_TIME_S = 5.0
"""Time a chat template gets for one batch of prompts, plus ``TEMPLATE_TIME_PER_PROMPT_S`` a prompt
(a real template renders a prompt in about 0.05 ms, yet a loaded machine can stall a process for
a second; a template is code from the model folder, and two nested loops there would otherwise
stall every run)."""
TEMPLATE_TIME_PER_PROMPT_S = 0.002
TEMPLATE_MAX_CHARS = 2**16
"""Characters a chat template may add to a prompt's own text (a long system preamble is ~10k)."""
TOKENIZE_TIME_S = 20.0
"""Time a tokenizer gets to measure a run's prompts, plus ``TOKENIZE_TIME_PER_CHAR_S`` a character
(a fresh process loads SmolLM2's tokenizer in about 0.3 s and tokenizes about 4 MB/s on one
thread; a tokenizer.json regex can be quadratic in the text, under its library's backtracking
limit)."""
TOKENIZE_TIME_PER_CHAR_S = 2e-6
TOKENIZE_MEMORY_BYTES = 4 * 2**30
"""Memory the process measuring the prompts may take (a tokenizer.json normalizer can multiply
the text without end)."""

# Run in a fresh process: the Rust code of a fast tokenizer holds the interpreter, so no signal
# stops a quadratic regex, and a normalizer that multiplies the text exhausts the memory; in the
# run's own process either would be a wait without end or a crash. Prints the lengths as JSON.
_MEASURE = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1])))
from tokenizers import Tokenizer
spec, texts = sys.stdin.buffer.read().split(b"\\0", 1)
tokenizer = Tokenizer.from_str(spec.decode())
tokenizer.no_padding()
tokenizer.no_truncation()
texts, special, lengths = json.loads(texts), sys.argv[2] == "1", []
for i in range(0, len(texts), 256):
    lengths += [len(row.ids) for row in tokenizer.encode_batch(texts[i:i + 256], add_special_tokens=special)]
sys.stdout.write(json.dumps(lengths))
"""


def measure_in_child(spec: str, texts: Sequence[str], add_special_tokens: bool) -> list[int] | str:
    """The token count of each of ``texts`` under the Rust tokenizer ``spec`` (its JSON), measured
    in a separate process under a time and a memory limit; or why it could not be (a string)."""
    limit = TOKENIZE_TIME_S + TOKENIZE_TIME_PER_CHAR_S * sum(len(t) for t in texts)
    env = child_environment(TOKENIZERS_PARALLELISM="false")
    try:
        done = subprocess.run([sys.executable, "-I", "-c", _MEASURE, str(TOKENIZE_MEMORY_BYTES), str(int(add_special_tokens))],
                              input=spec.encode() + b"\0" + json.dumps(list(texts)).encode(),
                              capture_output=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        return f"it took more than {limit:.3g} s to tokenize {len(texts)} prompt(s)"
    except OSError as err:  # no process to spare: nothing measured is nothing safe to tokenize here
        return f"no process could be started to measure the prompts ({err.strerror or err})"
    said = done.stderr.decode(errors="replace").strip().splitlines()
    if b"PanicException" in done.stderr:
        return f"it fails on a prompt (tokenizers panicked: {said[-1] if said else ''})"
    if done.returncode < 0 or b"MemoryError" in done.stderr or b"memory allocation" in done.stderr:
        return (f"tokenizing the prompts ran out of {TOKENIZE_MEMORY_BYTES / 2**30:g} GiB of memory or crashed "
                f"(exit {done.returncode})")
    try:
        lengths = json.loads(done.stdout)
    except ValueError:
        lengths = None
    if done.returncode != 0 or not isinstance(lengths, list) or len(lengths) != len(texts):
        return f"it fails on a prompt ({said[-1] if said else f'exit {done.returncode}'})"
    return lengths


@dataclass
class PromptFormatter:
    """Turns task prompts (user text) into the token ids the model is conditioned on.

    With ``use_chat_template`` and a tokenizer that has one, the prompt is a chat with an
    optional system message and the generation prompt appended; otherwise it is the raw text
    (and the tokenizer adds its usual special tokens, e.g. BOS). The template runs under a time
    and size bound, and a template or tokenizer that fails on a prompt is one
    ``TclightningError`` naming the tokenizer.
    """

    tokenizer: PreTrainedTokenizerBase
    system_prompt: str | None = None
    use_chat_template: bool = True

    @property
    def templated(self) -> bool:
        return self.use_chat_template and bool(getattr(self.tokenizer, "chat_template", None))

    def render(self, user_text: str) -> str:
        return self.render_all([user_text])[0]

    def render_all(self, prompts: Sequence) -> list[str]:
        """Each prompt as the model's input text; the chat template gets one time budget for all."""
        if not self.templated or not prompts:
            return [self._render_one(p) for p in prompts]
        # the first prompt alone first: a template that loops is refused in a second, not a minute
        return self._bounded(prompts[:1]) + self._bounded(prompts[1:])

    def _bounded(self, prompts: Sequence) -> list[str]:
        limit = TEMPLATE_TIME_S + TEMPLATE_TIME_PER_PROMPT_S * len(prompts)
        try:
            return waited_on(lambda: [self._render_one(p) for p in prompts], limit)
        except TclightningError:
            raise
        except TimeoutError:
            raise self._refusal(f"its chat template took more than {limit:.3g} s on {len(prompts)} prompt(s)") from None
        except (Exception, MemoryError) as err:  # noqa: BLE001 - the template is the model folder's code, not ours
            raise self._refusal(f"its chat template fails on a prompt ({type(err).__name__}{': ' if str(err) else ''}"
                                f"{err})") from None

    def _render_one(self, user_text: str) -> str:
        if self.templated:
            messages = [{"role": "user", "content": user_text}]
            if self.system_prompt:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            return self._apply_template(messages)
        return f"{self.system_prompt}\n{user_text}" if self.system_prompt else user_text

    def _apply_template(self, messages: list[dict[str, str]]) -> str:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not isinstance(text, str) or len(text) > sum(len(m["content"]) for m in messages) + TEMPLATE_MAX_CHARS:
            raise self._refusal(f"its chat template adds more than {TEMPLATE_MAX_CHARS} characters to a prompt")
        return text

    def _refusal(self, reason: str) -> TclightningError:
        name = getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__
        return TclightningError(f"the tokenizer of {name}: {' '.join(reason.split())[:300]}")

    def tokenize(self, texts: list[str], **kwargs: object) -> dict:
        """``tokenizer(texts, **kwargs)``; a tokenizer that panics on them (a Rust tokenizer's
        regex past its backtracking limit) is one ``TclightningError``."""
        try:
            return self.tokenizer(texts, **kwargs)
        except BaseException as err:
            if type(err).__name__ != "PanicException":  # pyo3's, a BaseException; importable from nowhere
                raise
            raise self._refusal(f"it fails on a prompt (tokenizers panicked: {err})") from None

    def lengths(self, user_texts: Sequence[str]) -> list[int]:
        """How many tokens :meth:`encode` gives each prompt, without padding, within one time
        budget for all. A fast (Rust) tokenizer measures them in a separate process under a time and
        a memory limit (:func:`measure_in_child`: no signal stops its code, and every prompt a
        run trains on is measured there before the run's own process tokenizes it); a Python one
        here, under the same time budget."""
        texts = self.render_all(user_texts)
        if not texts:
            return []
        special = not self.templated
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            measured = measure_in_child(backend.to_str(), texts, special)
            if isinstance(measured, str):
                raise self._refusal(measured)
            return measured
        limit = TOKENIZE_TIME_S + TOKENIZE_TIME_PER_CHAR_S * sum(len(t) for t in texts)
        try:
            return waited_on(lambda: [len(row) for row in self.tokenize(texts, add_special_tokens=special)["input_ids"]],
                          limit)
        except TimeoutError:
            raise self._refusal(f"it took more than {limit:.3g} s to tokenize {len(texts)} prompt(s)") from None

    def encode(self, user_texts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Left-padded ``input_ids``/``attention_mask`` for a batch of prompts."""
        return self.tokenize(
            self.render_all(user_texts),
            return_tensors="pt",
            padding=True,
            padding_side="left",
            add_special_tokens=not self.templated,
        )


def sequence_seed(seed: int, step: int, salt: int = 0) -> int:
    """A 63-bit seed for (run seed, step, salt): each step's sampling is reproducible on its own."""
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + salt * 0x94D049BB133111EB) % (1 << 63)
    return mixed
