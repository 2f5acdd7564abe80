"""Codec math: exact-k PRF indices, determinism across processes, reconstruction, gradients, bytes."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tclightning.codecs import (
    CodecKey,
    IdentityCodec,
    PRFCodec,
    PRFIndexer,
    SVDCodec,
    budget_k,
    make_codec,
    payload_nbytes,
)
from tclightning.codecs.prf import MASK32, mix32

ROOT = Path(__file__).resolve().parents[1]


def _mix32_reference(x: int) -> int:
    """lowbias32 in unbounded Python ints, as published."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def test_mix32_tensor_matches_unbounded_integer_reference() -> None:
    rng = random.Random(0)
    values = [0, 1, MASK32, 2**31, 2**31 - 1] + [rng.getrandbits(32) for _ in range(1000)]
    hashed = mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert hashed == [_mix32_reference(v) for v in values]
    assert all(mix32(v) == _mix32_reference(v) for v in values[:50])  # the scalar path too


@pytest.mark.parametrize(("dim", "k"), [(64, 8), (97, 5), (1536, 77), (576, 29), (12, 12), (7, 1)])
def test_prf_indices_are_exactly_k_distinct_and_in_range(dim: int, k: int) -> None:
    idx = PRFIndexer(dim, k).indices(CodecKey(seed=3, step=5, cut=2, row_offset=4), 3, 40)
    assert idx.shape == (3, 40, k) and idx.dtype == torch.int64
    assert int(idx.min()) >= 0 and int(idx.max()) < dim
    assert (idx.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct per token


def test_prf_keeps_every_channel_with_probability_k_over_d() -> None:
    dim, k, tokens = 48, 6, 4000
    idx = PRFIndexer(dim, k).indices(CodecKey(seed=0, step=0, cut=0), 4, tokens // 4)
    counts = torch.bincount(idx.reshape(-1), minlength=dim).float()
    expected = tokens * k / dim  # 500
    assert (counts - expected).abs().max() < 5 * expected**0.5


def test_different_step_cut_seed_or_token_give_different_indices() -> None:
    indexer = PRFIndexer(256, 13)
    base = CodecKey(seed=1, step=10, cut=6)

    def kept_sets(key: CodecKey) -> torch.Tensor:
        return indexer.indices(key, 2, 64).sort(-1).values

    reference = kept_sets(base)
    assert torch.equal(reference, kept_sets(CodecKey(seed=1, step=10, cut=6)))
    for other in (
        CodecKey(seed=1, step=11, cut=6),
        CodecKey(seed=1, step=10, cut=13),
        CodecKey(seed=2, step=10, cut=6),
        CodecKey(seed=1, step=10, cut=6, stream=1),
        CodecKey(seed=1, step=10, cut=6, row_offset=2),
    ):
        differs = (kept_sets(other) != reference).any(-1).float().mean()
        assert differs > 0.95, other
    # tokens within one message differ from each other too (up to birthday collisions among S*d sets)
    flat = reference.reshape(-1, 13)
    assert len({tuple(row.tolist()) for row in flat}) >= 0.95 * flat.shape[0]


@pytest.mark.parametrize(("dim", "k", "strides"), [(1536, 77, 16), (128, 6, 16), (97, 5, 3), (7, 1, 16)])
def test_prf_table_keeps_every_channel_equally_often_and_sorted(dim: int, k: int, strides: int) -> None:
    """Uniform slots over the table give P(channel kept) = k/d exactly iff every channel fills the
    same number of table entries: S*k of the S*d*k."""
    indexer = PRFIndexer(dim, k, strides=strides)
    table = indexer.table(seed=4, cut=9)
    assert table.shape == (indexer.strides * dim, k)
    assert torch.bincount(table.reshape(-1), minlength=dim).eq(indexer.strides * k).all()
    assert (table.diff(dim=-1) > 0).all()  # sorted, distinct


def test_prf_indices_are_pinned() -> None:
    """Changing the construction changes what every run/checkpoint agreed on: do it on purpose."""
    first = PRFIndexer(1536, 77).indices(CodecKey(seed=0, step=1, cut=6), 1, 2)[0, :, :8]
    assert first.tolist() == [[6, 8, 12, 43, 59, 61, 81, 131], [1, 2, 4, 8, 23, 43, 71, 72]]
    small = PRFIndexer(64, 8).indices(CodecKey(seed=5, step=2, cut=1, row_offset=3), 2, 1)[:, 0]
    assert small.tolist() == [[6, 8, 9, 11, 19, 36, 44, 56], [7, 11, 31, 34, 48, 50, 58, 59]]


def test_same_key_gives_same_indices_in_another_process() -> None:
    key = {"seed": 123456789012, "step": 7, "cut": 13, "row_offset": 5}
    script = (
        "import json, torch\n"
        "from tclightning.codecs import PRFIndexer, CodecKey\n"
        f"idx = PRFIndexer(1536, 77).indices(CodecKey(**{key!r}), 3, 50)\n"
        "print(json.dumps(idx.tolist()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    here = PRFIndexer(1536, 77).indices(CodecKey(**key), 3, 50)
    assert json.loads(done.stdout) == here.tolist()


def test_prf_round_trip_keeps_exact_values_and_zero_fills_the_rest() -> None:
    codec = PRFCodec(32, 4)
    key = CodecKey(seed=0, step=1, cut=0)
    x = torch.randn(2, 5, 32)
    payload = codec.encode(x, key)
    assert payload.shape == (2, 5, 4)
    x_hat = codec.decode(payload, key)
    kept = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, codec.indices(key, 2, 5, "cpu"), True)
    assert torch.equal(x_hat[kept], x[kept])
    assert (x_hat[~kept] == 0).all()
    assert kept.sum(-1).eq(4).all()
    # 2-D input is one row of positions
    assert codec.decode(codec.encode(x[0], key), key).shape == (5, 32)


def test_prf_rescale_is_unbiased_over_keys() -> None:
    dim, k = 16, 4
    codec = PRFCodec(dim, k, rescale=True)
    x = torch.randn(1, 1, dim)
    estimates = [codec.decode(codec.encode(x, CodecKey(0, step, 0)), CodecKey(0, step, 0)) for step in range(6000)]
    mean = torch.stack(estimates).mean(0)
    assert (mean - x).abs().max() < 0.15 * x.abs().max() + 0.1


def test_gradient_reaches_the_sender_only_through_kept_coordinates() -> None:
    codec = PRFCodec(40, 5, rescale=True)
    key = CodecKey(seed=9, step=2, cut=1)
    x = torch.randn(3, 7, 40, requires_grad=True)
    payload = codec.encode(x, key)
    payload.retain_grad()
    weights = torch.randn(3, 7, 40)
    (codec.decode(payload, key) * weights).sum().backward()
    idx = codec.indices(key, 3, 7, "cpu")
    kept = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, idx, True)
    assert payload.grad is not None and payload.grad.shape == (3, 7, 5)  # the [tokens, k] backward message
    assert (x.grad[~kept] == 0).all()
    assert torch.allclose(x.grad[kept], (weights * 40 / 5)[kept])
    assert torch.allclose(x.grad.gather(-1, idx), payload.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_payload_bytes_equal_k_times_element_size(dtype: torch.dtype) -> None:
    codec = make_codec("prf", 1536, rate=0.05)
    assert codec.k == 77  # type: ignore[attr-defined]
    x = torch.randn(2, 9, 1536).to(dtype)
    payload = codec.encode(x, CodecKey(0, 0, 0))
    assert payload_nbytes(payload) == codec.payload_bytes(18, dtype) == 18 * 77 * dtype.itemsize
    assert codec.payload_bytes_per_token(torch.bfloat16) == 154
    assert IdentityCodec(1536).payload_bytes_per_token(torch.bfloat16) == 3072


def test_budget_rounds_half_up_and_validates() -> None:
    assert budget_k(1536, rate=0.05) == 77
    assert budget_k(576, rate=0.05) == 29
    assert budget_k(64, k=8) == 8
    with pytest.raises(ValueError):
        budget_k(64, k=65)
    with pytest.raises(ValueError):
        make_codec("topk", 64)


def test_svd_codec_reconstructs_low_rank_activations() -> None:
    torch.manual_seed(0)
    basis = torch.linalg.qr(torch.randn(32, 3)).Q
    x = (torch.randn(4, 30, 3) @ basis.T) + torch.linspace(0, 1, 32)
    codec = SVDCodec(32, 3)
    codec.calibrate(x)
    assert codec.energy_kept == pytest.approx(1.0, abs=1e-6)
    payload = codec.encode(x, CodecKey(0, 0, 0))
    assert payload.shape == (4, 30, 3)
    assert torch.allclose(codec.decode(payload, CodecKey(0, 0, 0)), x, atol=1e-4)
    assert codec.payload_bytes(10, torch.float32) == 10 * 3 * 4


def test_bench_codec_cli_reports_the_issue_keys(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from tclightning.cli import bench
    from tclightning.cli.main import dispatch

    parser = argparse.ArgumentParser()
    parser.add_argument("--debug", action="store_true")
    bench.register(parser.add_subparsers())
    assert (
        dispatch(
            parser,
            [
                "bench",
                "codec",
                "--json",
                "--tokens",
                "64",
                "--dim",
                "32",
                "--k",
                "4",
                "--repeats",
                "2",
                "--warmup",
                "1",
            ],
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    for key in ("clone_ms", "encode_ms", "decode_ms", "payload_bytes_per_token", "dense_bytes_per_token"):
        assert key in result
    assert result["payload_bytes_per_token"] == 16 and result["dense_bytes_per_token"] == 128


def test_bench_codec_times_the_basis_with_its_token_centres() -> None:
    from tclightning.bench.codec import bench_codec

    result = bench_codec(tokens=2048, dim=32, k=4, repeats=1, warmup=0, codec_name="lowrank")
    assert result["codec"] == "lowrank" and result["payload_bytes_per_token"] == 16
    assert result["decode_over_zero_fill"] > 0  # timed beside the zero-fill PRF decode
