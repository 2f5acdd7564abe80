"""Timing of a codec (PRF by default) against a plain copy of the boundary tensor (``tclightning bench codec``).

The reference is ``x.clone()`` of the [tokens, d] activation: a decoder has to write the d-vector
anyway, so one copy is the floor for encode + decode. Encode always includes index generation.
Decode is timed twice: as it runs in one process (in-graph, reusing the indices encode just
generated) and as a separate receiver runs it (regenerating the indices from the key).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from tclightning.codecs.base import CodecKey
from tclightning.codecs.context import context_keys
from tclightning.codecs import make_codec
from tclightning.codecs.prf import PRFCodec

BENCH_CODECS = ("prf", "lowrank", "lowrank-4bit", "lowrank-entropy")
"""``lowrank``: float coefficients; ``lowrank-4bit``: 4-bit ones beside a 16-bit lead (``pipeline.bits=4
pipeline.bits_lead=true``, as ``fast-only-lowrank``); ``lowrank-entropy``: entropy-coded ones
(``pipeline.entropy_coding``)."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    def timed(fn: Callable[[], Any]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) * 1e3

    return timed


def bench_codec(
    *,
    tokens: int = 8192,
    dim: int = 1536,
    k: int = 77,
    dtype: str = "float32",
    repeats: int = 25,
    warmup: int = 3,
    device: str = "cpu",
    threads: int | None = None,
    seed: int = 0,
    codec_name: str = "prf",
) -> dict[str, Any]:
    """Median milliseconds over ``repeats`` rounds (after ``warmup``) on a [tokens, d] activation;
    all steps are interleaved within each round so that noise from other processes hits them alike.

    Returns ``clone_ms`` (``x.clone()``), ``encode_ms`` (index generation + gather), ``decode_ms``
    (zero fill + scatter with the indices encode generated: the one-process path),
    ``receiver_decode_ms`` (decode regenerating the indices: a separate receiver), ``index_ms``
    (index generation alone), ``encode_over_clone``, ``roundtrip_over_clone`` ((encode + decode) /
    clone), ``receiver_roundtrip_over_clone``, ``payload_bytes_per_token`` (k x element size),
    ``dense_bytes_per_token`` (d x element size), ``compression`` (dense / payload) and the
    settings (``tokens``, ``dim``, ``k``, ``dtype``, ``device``, ``threads``, ``repeats``, ``codec``).

    ``codec_name``: ``prf`` (default), or ``lowrank`` with a basis and token centres fitted on
    ``x`` and its ids (rank ``k``; the ids are drawn from 1024 distinct values), the ids handed to
    every encode and decode; its decode is timed beside the zero-fill PRF decode of the same
    budget in the same rounds: ``zero_decode_ms``, ``zero_receiver_decode_ms`` and
    ``decode_over_zero_fill`` (decode / zero-fill decode, in-process) side by side."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    if threads is not None:
        torch.set_num_threads(threads)
    torch_dtype = DTYPES[dtype]
    target = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=generator).to(target, torch_dtype)
    if codec_name not in BENCH_CODECS:
        raise ValueError(f"codec must be one of {', '.join(BENCH_CODECS)}, got {codec_name}")
    # context keys (each token and the one before it), as every cut receives them
    token_ids = context_keys(torch.randint(0, TOKEN_IDS, (1, tokens), generator=generator)).to(target)
    codec: Any = PRFCodec(dim, k) if codec_name == "prf" else _fitted_basis(codec_name, x, k, token_ids)
    zero_codec = PRFCodec(dim, k)
    key = CodecKey(seed=seed, step=1, cut=6)
    timed = _timer(target)
    # the batch's token ids: side information of the basis' token centres (one id per row of x,
    # on both sides)
    sender_side: dict[str, Any] = {}
    receiver_side: dict[str, Any] = {}
    if codec_name != "prf":
        sender_side = receiver_side = {"token_ids": token_ids.reshape(-1)}
    payload = codec.encode(x, key, **sender_side)
    forget = getattr(codec, "clear_cache", lambda: None)  # PRF caches the indices encode generated

    def encode() -> Any:
        forget()
        return codec.encode(x, key, **sender_side)

    def decode_in_process() -> Any:  # indices cached by the encode that produced the payload
        return codec.decode(payload, key, **receiver_side)

    def decode_at_receiver() -> Any:
        forget()
        return codec.decode(payload, key, **receiver_side)

    def indices() -> Any:
        return zero_codec.indexer.indices(key, 1, tokens, target)

    steps = {
        "clone": x.clone,
        "index": indices,
        "encode": encode,
        "decode": decode_in_process,
        "receiver_decode": decode_at_receiver,
    }
    side = codec_name != "prf"
    if side:
        zero_payload = zero_codec.encode(x, key)  # caches the indices: the in-process path

        def zero_decode() -> Any:
            return zero_codec.decode(zero_payload, key)

        def zero_receiver_decode() -> Any:
            zero_codec.clear_cache()
            return zero_codec.decode(zero_payload, key)

        steps["zero_decode"] = zero_decode
        steps["zero_receiver_decode"] = zero_receiver_decode
    samples: dict[str, list[float]] = {name: [] for name in steps}
    with torch.no_grad():
        for round_index in range(warmup + repeats):
            times = {name: timed(fn) for name, fn in steps.items()}
            if round_index >= warmup:
                for name, value in times.items():
                    samples[name].append(value)
    median = {name: statistics.median(values) for name, values in samples.items()}
    clone_ms, encode_ms, decode_ms = median["clone"], median["encode"], median["decode"]
    payload_bytes = codec.payload_bytes_per_token(torch_dtype)
    dense = dim * torch_dtype.itemsize
    side_by_side: dict[str, Any] = {}
    if side:
        side_by_side = {
            "zero_decode_ms": round(median["zero_decode"], 3),
            "zero_receiver_decode_ms": round(median["zero_receiver_decode"], 3),
            "decode_over_zero_fill": round(decode_ms / median["zero_decode"], 3),
            "receiver_decode_over_zero_fill": round(median["receiver_decode"] / median["zero_receiver_decode"], 3),
        }
    return {
        "clone_ms": round(clone_ms, 3),
        "encode_ms": round(encode_ms, 3),
        "decode_ms": round(decode_ms, 3),
        "index_ms": round(median["index"], 3),
        "receiver_decode_ms": round(median["receiver_decode"], 3),
        "encode_over_clone": round(encode_ms / clone_ms, 3),
        "roundtrip_over_clone": round((encode_ms + decode_ms) / clone_ms, 3),
        "receiver_roundtrip_over_clone": round((encode_ms + median["receiver_decode"]) / clone_ms, 3),
        "payload_bytes_per_token": int(payload_bytes),
        "dense_bytes_per_token": dense,
        "compression": round(dense / payload_bytes, 2),
        "tokens": tokens,
        "dim": dim,
        "k": k,
        "dtype": dtype,
        "device": str(target),
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "codec": codec_name,
        **side_by_side,
    }


def _fitted_basis(name: str, x: torch.Tensor, k: int, token_ids: torch.Tensor) -> Any:
    """A ``lowrank`` codec with its basis and token centres fitted on ``x`` and its
    ``token_ids`` (the steady state); ``lowrank-4bit`` and ``lowrank-entropy``: quantised at the
    bytes of ``k`` values of ``x``'s dtype."""
    quantised = {"bits": 4, "bits_lead": True} if name == "lowrank-4bit" else {}
    codec = make_codec("lowrank", x.shape[-1], k=k, entropy_coding=name == "lowrank-entropy",
                       value_bytes=x.element_size(), **quantised)
    codec.observe_dense(x.float(), token_ids.reshape(-1))  # x: [tokens, d]
    codec.fit_shared(1)
    return codec


TOKEN_IDS = 1024
"""Distinct token ids in the timed batch (each gets its own centre in the ``lowrank`` codec's table)."""
