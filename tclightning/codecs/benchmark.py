"""Timing of the PRF codec against a plain copy of the boundary tensor (``tclightning bench codec``).

The reference is ``x.clone()`` of the [tokens, d] activation: a decoder has to write the d-vector
anyway, so one copy is the floor for encode + decode. Index generation is included on *both*
sides (the receiver regenerates the indices from the key; nothing is cached between them).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from tclightning.codecs.base import CodecKey
from tclightning.codecs.prf import PRFCodec

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
) -> dict[str, Any]:
    """Median milliseconds over ``repeats`` rounds (after ``warmup``) of ``clone``, PRF ``encode``
    and PRF ``decode`` (zero fill) on a [tokens, d] activation; the three are interleaved within
    each round so that noise from other processes hits them alike.

    Returns ``clone_ms``, ``encode_ms``, ``decode_ms``, ``encode_over_clone``,
    ``roundtrip_over_clone`` ((encode + decode) / clone), ``payload_bytes_per_token`` (k x element
    size), ``dense_bytes_per_token`` (d x element size), ``compression`` (dense / payload) and the
    settings (``tokens``, ``dim``, ``k``, ``dtype``, ``device``, ``threads``, ``repeats``)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    if threads is not None:
        torch.set_num_threads(threads)
    torch_dtype = DTYPES[dtype]
    target = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=generator).to(target, torch_dtype)
    codec = PRFCodec(dim, k)
    key = CodecKey(seed=seed, step=1, cut=6)
    timed = _timer(target)
    payload = codec.encode(x, key)

    def encode() -> Any:
        codec.clear_cache()
        return codec.encode(x, key)

    def decode() -> Any:
        codec.clear_cache()
        return codec.decode(payload, key)

    samples: dict[str, list[float]] = {"clone": [], "encode": [], "decode": []}
    with torch.no_grad():
        for round_index in range(warmup + repeats):
            times = {"clone": timed(x.clone), "encode": timed(encode), "decode": timed(decode)}
            if round_index >= warmup:
                for name, value in times.items():
                    samples[name].append(value)
    clone_ms, encode_ms, decode_ms = (statistics.median(samples[name]) for name in ("clone", "encode", "decode"))
    payload_bytes = codec.payload_bytes_per_token(torch_dtype)
    dense = dim * torch_dtype.itemsize
    return {
        "clone_ms": round(clone_ms, 3),
        "encode_ms": round(encode_ms, 3),
        "decode_ms": round(decode_ms, 3),
        "encode_over_clone": round(encode_ms / clone_ms, 3),
        "roundtrip_over_clone": round((encode_ms + decode_ms) / clone_ms, 3),
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
    }
