"""The ``vllm`` sampler backend: a vLLM engine colocated with the trainer on one GPU.

Supported: vLLM >= 0.10.2 (the V1 engine), the first release whose ``logprobs_mode=
"processed_logprobs"`` returns the log-probs of the distribution a token was sampled from,
temperature included. **Not yet run on a GPU** (see ``docs/vllm.md`` for the check script).

What it does, per ``generate`` call:

1. **Engine** (first call only): the policy is written once with ``save_pretrained`` to a temporary
   folder and vLLM is started from it in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with
   ``skip_tokenizer_init=True`` -- prompts go in as token ids from the sampler's own
   :class:`PromptFormatter`, completions are decoded by the same tokenizer, so both backends see
   identical tokens.
2. **Weights**: if the policy's parameters changed since the last push (their in-place version
   counters moved, which every optimizer step does), they are pushed into the running engine with
   ``LLM.collective_rpc`` -> :class:`WeightSyncExtension` -> the vLLM model's own ``load_weights``
   (it maps HF names onto vLLM's fused layers). No restart; in-process, so no copy through a pipe.
3. **Generation**: one request per sequence (``group_size`` copies of each prompt), each with its
   own seed ``sequence_seed(seed, 0, salt=row)``, ``logprobs=0`` (the sampled token's log-prob
   only), ``stop_token_ids=[eos]``; greedy = temperature 0.
4. **Log-probs**: with ``top_p = 1`` the processed log-prob is ``log_softmax(logits / T)`` at the
   sampled token -- the HF backend's and the trainer's definition. With ``top_p < 1`` vLLM
   renormalises over the nucleus, so ``logp_sampler`` differs from the HF backend's (a warning says so).

Colocation: ``sampler.vllm.gpu_memory_utilization`` caps what vLLM takes; ``sampler.vllm.sleep`` frees
its KV cache and offloads its weights between calls. A separate-GPU mode is not implemented.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from tclightning.errors import TclightningError
from tclightning.sampling.base import PromptFormatter, Rollouts, sequence_seed
from tclightning.sampling.config import SamplerConfig
from tclightning.sampling.hf import assemble_rollouts

MIN_VERSION = "0.10.2"
EXTENSION = "tclightning.sampling.vllm.WeightSyncExtension"
_LOAD_METHOD = "tclightning_load_weights"


def require_vllm() -> Any:
    """The ``vllm`` module, or a one-line :class:`TclightningError` saying what is missing
    (a CUDA GPU, the package, or a recent enough version)."""
    if not torch.cuda.is_available():
        raise TclightningError(
            "sampler.backend: 'vllm' needs a CUDA GPU and none is visible; use sampler.backend=hf on this machine"
        )
    try:
        import vllm
    except ImportError:
        raise TclightningError(
            f"sampler.backend: 'vllm' needs the vllm package (>= {MIN_VERSION}): pip install 'tclightning[vllm]'"
        ) from None
    from packaging.version import Version

    if Version(vllm.__version__).release < Version(MIN_VERSION).release:
        raise TclightningError(
            f"sampler.backend: vllm {vllm.__version__} is too old; tclightning needs >= {MIN_VERSION} "
            "(processed log-probs with temperature)"
        )
    return vllm


class WeightSyncExtension:
    """Mixed into vLLM's GPU worker (``LLM(worker_extension_cls=EXTENSION)``): the method the
    sampler calls through ``LLM.collective_rpc`` to load new weights in place."""

    def tclightning_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Load ``(HF parameter name, tensor)`` pairs into the running model; returns how many."""
        self.model_runner.model.load_weights(weights=weights)  # type: ignore[attr-defined]
        return len(weights)


def weights_version(model: torch.nn.Module) -> tuple[int, ...]:
    """The parameters' in-place version counters: any optimizer step (or ``load_state_dict``)
    changes at least one, reading them costs nothing."""
    return tuple(p._version for p in model.parameters())


def prompt_token_lists(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Left-padded prompt rows -> the real token ids of each (what vLLM is given)."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]


def sampled_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Any]] | None) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-position ``{token_id: Logprob}`` dicts."""
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RuntimeError("vllm returned no per-token log-probs (SamplingParams.logprobs must be 0)")
    return [float(step[token].logprob) for token, step in zip(token_ids, logprobs)]


def outputs_to_chunk(
    outputs: Sequence[Any], input_ids: torch.Tensor, attention_mask: torch.Tensor, pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM ``RequestOutput`` list (one per row, in order) -> ``(prompt ids, prompt mask, completion
    ids, logp)``, completions right padded with ``pad`` (the chunk format of :func:`assemble_rollouts`)."""
    completions = [list(out.outputs[0].token_ids) for out in outputs]
    logps = [sampled_logprobs(c, out.outputs[0].logprobs) for c, out in zip(completions, outputs)]
    width = max(max((len(c) for c in completions), default=0), 1)
    ids = torch.full((len(completions), width), pad, dtype=torch.long)
    logp = torch.zeros(len(completions), width, dtype=torch.float32)
    for row, (tokens, values) in enumerate(zip(completions, logps)):
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        logp[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return input_ids, attention_mask, ids, logp


class VLLMSampler:
    """Generates with a vLLM engine that holds a copy of the policy, kept in sync after every update.

    Same contract as :class:`~tclightning.sampling.hf.HFSampler` (``generate`` returns
    :class:`Rollouts` whose rows of one prompt are contiguous, ``logp_sampler`` =
    ``log_softmax(logits / T)`` at each sampled token); the engine starts on the first call.
    """

    def __init__(self, cfg: SamplerConfig, formatter: PromptFormatter) -> None:
        self.vllm = require_vllm()
        share = cfg.vllm_options.gpu_memory_utilization
        if not 0.0 < share <= 1.0:
            raise TclightningError(f"sampler.vllm.gpu_memory_utilization must be in (0, 1], got {share}")
        if cfg.top_p < 1.0:
            warnings.warn(
                "sampler.top_p < 1 with vllm: the recorded log-probs are renormalised over the nucleus, "
                "the HF backend's and the trainer's are not",
                stacklevel=2,
            )
        self.cfg = cfg
        self.formatter = formatter
        self.tokenizer = formatter.tokenizer
        self.llm: Any = None
        self.weight_syncs = 0  # pushes into the running engine (the first load is not one)
        self._version: tuple[int, ...] | None = None
        self._model_dir: str | None = None

    # -- engine and weights --------------------------------------------------------------------
    def start(self, model: torch.nn.Module) -> None:
        """Start the engine from ``model``'s current weights (a ``save_pretrained`` copy)."""
        self._model_dir = tempfile.mkdtemp(prefix="tclightning-vllm-")
        model.save_pretrained(self._model_dir)
        # In-process engine core: collective_rpc then hands our tensors to the worker directly.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        cfg, engine = self.cfg, self.cfg.vllm_options
        self.llm = self.vllm.LLM(
            model=self._model_dir,
            skip_tokenizer_init=True,
            dtype="auto",
            seed=cfg.seed,
            gpu_memory_utilization=engine.gpu_memory_utilization,
            max_model_len=engine.max_model_len,
            enforce_eager=engine.enforce_eager,
            enable_sleep_mode=engine.sleep,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # ignore the checkpoint's sampling defaults: the recipe decides
            worker_extension_cls=EXTENSION,
        )
        self._version = weights_version(model)

    def update_weights(self, model: torch.nn.Module) -> None:
        """Push every parameter of ``model`` into the running engine (no restart)."""
        weights = [(name, param.detach()) for name, param in model.named_parameters()]
        self.llm.collective_rpc(_LOAD_METHOD, args=(weights,))
        self._version = weights_version(model)
        self.weight_syncs += 1

    def sync(self, model: torch.nn.Module) -> None:
        """Start the engine on first use; afterwards push the weights iff they changed."""
        if self.llm is None:
            self.start(model)
        elif weights_version(model) != self._version:
            self.update_weights(model)

    def close(self) -> None:
        """Shut the engine down and delete its checkpoint copy."""
        self.llm = None
        if self._model_dir:
            shutil.rmtree(self._model_dir, ignore_errors=True)
            self._model_dir = None

    # -- sampling ------------------------------------------------------------------------------
    def sampling_params(self, rows: int, seed: int, greedy: bool, max_new: int) -> list[Any]:
        """One ``SamplingParams`` per sequence, each with its own seed (row-salted)."""
        cfg = self.cfg
        common: dict[str, Any] = {
            "max_tokens": max_new,
            "logprobs": 0,
            "detokenize": False,
            "stop_token_ids": [self.tokenizer.eos_token_id],
            "temperature": 0.0 if greedy else cfg.temperature,
            "top_p": 1.0 if greedy else cfg.top_p,
        }
        return [self.vllm.SamplingParams(seed=sequence_seed(seed, 0, salt=row), **common) for row in range(rows)]

    @torch.no_grad()
    def generate(
        self,
        model: torch.nn.Module,
        prompts: Sequence[str],
        *,
        group_size: int,
        seed: int,
        greedy: bool = False,
        max_new_tokens: int | None = None,
    ) -> Rollouts:
        max_new = max_new_tokens or self.cfg.max_new_tokens
        sleeps = self.cfg.vllm_options.sleep
        if sleeps and self.llm is not None:
            self.llm.wake_up()  # before the weight push: a sleeping engine has its weights offloaded
        self.sync(model)
        expanded = [p for p in prompts for _ in range(group_size)]
        encoded = self.formatter.encode(expanded)
        requests = [
            {"prompt_token_ids": ids} for ids in prompt_token_lists(encoded["input_ids"], encoded["attention_mask"])
        ]
        try:
            outputs = self.llm.generate(requests, self.sampling_params(len(expanded), seed, greedy, max_new), use_tqdm=False)
        finally:
            if sleeps:
                self.llm.sleep(level=1)
        chunk = outputs_to_chunk(outputs, encoded["input_ids"], encoded["attention_mask"], self.tokenizer.pad_token_id)
        return assemble_rollouts(self.tokenizer, [chunk], group_size, max_new)
