"""``sampler.dtype``: the sampler's own copy of the policy and the sparse sync that keeps it exact.

The codec (positions as LEB128 gaps or a bitmask, values in the sampler dtype) is exact and its
bytes are the formula; the copy stays bit-identical to the trainer's weights cast to the dtype over
many small AdamW steps, in one process and across two, through a checkpoint (whose float32 weights
a full sync brings up to date) and a rollback; a float32 copy samples exactly as the policy does.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tclightning.bench.launch import run_ranks
from tclightning.errors import RecipeError
from tclightning.weight_sync import (
    BITMASK,
    GAPS,
    HEADER,
    LENGTH_BYTES,
    SamplerCopy,
    WeightMirror,
    apply_message,
    decode,
    decode_positions,
    encode,
    encode_positions,
    leb128_decode,
    leb128_encode,
    message_bytes,
)
from tests.test_distributed import (
    ADVANTAGES,
    STEP,
    VOCAB,
    backend_request,
    config_for,
    rollouts,
    tiny_llama,
)

BF16 = torch.bfloat16


def sampling_request(model: torch.nn.Module, dtype: torch.dtype = BF16) -> Any:
    """The test backends' request, with a sampler copy in ``dtype``."""
    return dataclasses.replace(backend_request(model), sampler_dtype=dtype)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a 16- or 32-bit float tensor (NaN and -0.0 compare by them)."""
    return tensor.view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


def leb128_length(value: int) -> int:
    return max(1, math.ceil(value.bit_length() / 7))


def expected_bytes(before: list[torch.Tensor], after: list[torch.Tensor]) -> int:
    """What a sync from ``before`` to ``after`` (both in the sampler dtype) sends, from the
    formula: the length, then per tensor a 9-byte header, min(bitmask, LEB128 gaps) bytes of
    positions and the changed values; only the length when nothing changed."""
    total, changed = LENGTH_BYTES + HEADER.itemsize * len(before), 0
    for old, new in zip(before, after, strict=True):
        positions = torch.nonzero(bits(old).reshape(-1) != bits(new).reshape(-1)).reshape(-1).tolist()
        gaps = [b - a - 1 for a, b in zip([-1, *positions], positions)]
        total += min(math.ceil(old.numel() / 8), sum(leb128_length(g) for g in gaps))
        total += len(positions) * old.element_size()
        changed += len(positions)
    return total if changed else LENGTH_BYTES


# -- the codec ------------------------------------------------------------------------------------


def test_leb128_round_trips_values_of_every_width() -> None:
    values = torch.tensor([0, 1, 127, 128, 16383, 16384, 2**21, 2**31 - 1, 2**31, 2**40, 2**62], dtype=torch.long)
    data = leb128_encode(values)
    assert data.dtype == torch.uint8 and data.numel() == sum(leb128_length(int(v)) for v in values)
    assert data[:4].tolist() == [0, 1, 127, 0x80]  # 128 = 0x80 0x01
    assert torch.equal(leb128_decode(data), values)
    assert leb128_decode(leb128_encode(torch.empty(0, dtype=torch.long))).numel() == 0


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 1000, 4099])
def test_positions_take_the_shorter_code_and_decode_exactly(numel: int) -> None:
    gen = torch.Generator().manual_seed(numel)
    for density in (0.0, 0.003, 0.05, 0.2, 0.9, 1.0):
        positions = torch.nonzero(torch.rand(numel, generator=gen) < density).reshape(-1)
        if density == 1.0:
            positions = torch.arange(numel)
        code, data = encode_positions(positions, numel)
        gaps = [b - a - 1 for a, b in zip([-1, *positions.tolist()], positions.tolist())]
        gap_bytes, mask_bytes = sum(leb128_length(g) for g in gaps), math.ceil(numel / 8)
        assert (code, data.numel()) == ((GAPS, gap_bytes) if gap_bytes < mask_bytes else (BITMASK, mask_bytes))
        assert torch.equal(decode_positions(code, data, numel), positions)
    # both codes are reached: all changed is a bitmask, one change in a thousand is gaps
    assert encode_positions(torch.arange(1000), 1000)[0] == BITMASK
    assert encode_positions(torch.tensor([17]), 1000)[0] == GAPS


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_message_carries_exactly_the_changed_entries(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    now = [torch.randn(n, generator=gen) for n in (64, 1000, 333, 5)]  # the trainer's float32 weights
    now[3][:2] = torch.tensor([math.nan, 0.0])
    held = [t.to(dtype, copy=True) for t in now]  # as last sent
    now[1][torch.tensor([3, 200, 999])] += 1.0  # sparse: gaps
    now[2] = torch.randn(333, generator=gen)  # every entry: a bitmask
    now[3][1] = -0.0  # NaN stays NaN (unchanged); 0.0 -> -0.0 is a change
    message = encode(held, now)
    expected = [torch.nonzero(bits(h).reshape(-1) != bits(n.to(dtype)).reshape(-1)).reshape(-1)
                for h, n in zip(held, now)]
    assert [e.tolist() for e in expected[::3]] == [[], [1]]
    decoded = decode(message, [t.numel() for t in held], dtype)
    for (positions, values), want, current in zip(decoded, expected, now):
        assert torch.equal(positions, want)
        assert torch.equal(bits(values), bits(current.to(dtype)[want]))
    assert message.numel() + LENGTH_BYTES == message_bytes(message) == expected_bytes(held, [n.to(dtype) for n in now])
    receiver = [t.clone() for t in held]
    apply_message(receiver, message)
    for got, current in zip(receiver, now):
        assert torch.equal(bits(got), bits(current.to(dtype)))


def test_nothing_changed_sends_only_the_length_and_everything_changed_every_value() -> None:
    held = [torch.randn(100).to(BF16), torch.randn(3, 4).to(BF16)]
    message = encode(held, [t.float() for t in held])
    assert message.numel() == 0 and message_bytes(message) == LENGTH_BYTES
    assert all(p.numel() == 0 for p, _ in decode(message, [100, 12], BF16))
    now = [t.float() + 1.0 for t in held]
    message = encode(held, now)
    assert message_bytes(message) == LENGTH_BYTES + 2 * HEADER.itemsize + (13 + 2) + 2 * (100 + 12)
    mirror = WeightMirror(held)
    mirror.apply(message)
    assert all(torch.equal(bits(h), bits(n.to(BF16))) for h, n in zip(held, now))


# -- one process ----------------------------------------------------------------------------------


def test_one_process_keeps_the_copy_bit_identical_over_twenty_adamw_steps() -> None:
    """LocalBackend with a bfloat16 sampler copy: after every update (AdamW, lr 1e-6) the copy
    equals the float32 weights cast, and ``wire/sync_bytes`` is the formula's sync."""
    from tclightning.pipeline.backends import LocalBackend

    model = tiny_llama()
    backend = LocalBackend(sampling_request(model))
    sampler = backend.sampling_model()
    assert sampler is not model and next(sampler.parameters()).dtype == BF16
    assert sampler.lm_head.weight is sampler.model.embed_tokens.weight  # tied, as in the policy
    params = list(model.parameters())
    full = sum(p.numel() for p in params) * 2
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(0))
    shares = []
    for _ in range(20):
        before = [p.detach().to(BF16) for p in params]
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        backend.after_update()
        after = [p.detach().to(BF16) for p in params]
        wire = backend.wire_metrics()
        assert wire["wire/sync_bytes"] == expected_bytes(before, after)
        assert wire["wire/sync_share"] == wire["wire/sync_bytes"] / full
        shares.append(wire["wire/sync_share"])
        copies = dict(backend.sampling_model().named_parameters())
        for name, param in model.named_parameters():
            assert torch.equal(bits(copies[name]), bits(param.detach().to(BF16))), name
    assert backend.wire_metrics()["wire/sync_bytes"] == 0  # sampling_model found the copy current
    assert 0 < min(shares) and max(shares) < 0.2, shares
    # weights loaded outside an update (a rollback): the copy takes them, nothing is counted
    model.load_state_dict(tiny_llama(seed=3).state_dict())
    backend.weights_loaded()
    for name, param in backend.sampling_model().named_parameters():
        assert torch.equal(bits(param), bits(dict(model.named_parameters())[name].detach().to(BF16))), name
    assert backend.wire_metrics()["wire/sync_bytes"] == 0
    # transformers generates with the bfloat16 copy on CPU
    out = backend.sampling_model().generate(input_ids=ids[:1, :4], max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 6)


def test_the_copy_of_a_policy_with_cuts_installed_is_dense() -> None:
    """One-process ``PipelineStrategy``: the policy carries the cuts' hooks; its sampler copy has
    none, so a float32 copy gives the policy's dense logits exactly."""
    from tclightning.pipeline import CutSet, PipelineConfig
    from tclightning.pipeline.backends import LocalBackend

    model, ids = tiny_llama(), torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    with CutSet(model, PipelineConfig(stages=2, layout="all", k=5)) as cuts, torch.no_grad():
        cuts.set_step(STEP)
        sampler = LocalBackend(sampling_request(model, torch.float32), cuts).sampling_model()
        compressed = model(input_ids=ids).logits
        with cuts.bypassed():
            dense = model(input_ids=ids).logits
        assert torch.equal(sampler(input_ids=ids).logits, dense) and not torch.allclose(compressed, dense)


def test_a_sampler_copy_leaves_the_policy_alone() -> None:
    model = tiny_llama()
    copy = SamplerCopy(model, torch.float16)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())
    assert all(p.dtype == torch.float16 and not p.requires_grad for p in copy.model.parameters())
    assert not copy.model.training


def test_a_bad_sampler_dtype_is_refused_by_the_schema_in_one_line(tmp_path: Path) -> None:
    from tclightning.recipes.loader import load_recipe

    for value in ("int8", "bf16"):
        with pytest.raises(RecipeError) as info:
            load_recipe("tiny", [f"sampler.dtype={value}"])
        message = str(info.value)
        assert "\n" not in message and "sampler.dtype" in message
        assert "expected one of float32, bfloat16, float16" in message and repr(value) in message
    path = tmp_path / "bad.yaml"
    path.write_text("defaults: [tiny]\ndescription: x\nsampler: {dtype: float64}\n")
    with pytest.raises(RecipeError, match=r"bad.yaml.*sampler\.dtype.*float64"):
        load_recipe(str(path))
    assert load_recipe("tiny", ["sampler.dtype=null"]).sampler.dtype is None


def test_a_one_process_run_logs_the_sync_and_a_float32_copy_samples_as_the_policy(run_root: Path) -> None:
    """Through Lightning: ``sampler.dtype=float32`` samples from an exact copy, so the run equals
    the run without one in everything but the sync's metrics, which are logged and documented."""
    from tclightning.grpo.summary import read_metrics
    from tclightning.run import run
    from tests.conftest import FAST
    from tests.test_docs import undocumented

    settings = [*FAST, "trainer.steps=2", "trainer.val_every=1"]
    plain = read_metrics(Path(run("tiny", settings, quiet=True)["run_dir"]) / "metrics.csv")
    copied = read_metrics(Path(run("tiny", [*settings, "sampler.dtype=float32", "logging.name=copy"],
                                   quiet=True)["run_dir"]) / "metrics.csv")
    sparse = read_metrics(Path(run("tiny", [*settings, "sampler.dtype=bfloat16", "logging.name=bf16"],
                                   quiet=True)["run_dir"]) / "metrics.csv")
    for step, values in plain.items():
        for key in ("reward/mean", "loss/policy", "policy/grad_norm", "response/length_mean", "val/accuracy"):
            if key in values:
                assert copied[step][key] == values[key], (step, key)
    for rows in (copied, sparse):
        logged = set().union(*rows.values())
        assert {"wire/sync_bytes", "wire/sync_share"} <= logged and undocumented(logged) == set()
    assert all(0 < sparse[step]["wire/sync_share"] < 1 for step in sparse if "wire/sync_share" in sparse[step])


# -- two processes --------------------------------------------------------------------------------


def two_rank_worker(rank: int, world_size: int, lrs: list[float]) -> dict[str, Any]:
    """Rank ``rank`` of 2 stages with a bfloat16 sampler copy: one ``grpo_update`` (2 AdamW ticks)
    per entry of ``lrs``, each followed by the sparse sync; then a checkpoint's full sync, the next
    step's carried bytes, a rollback (every rank loads the same weights) and one more update."""
    from tclightning.grpo.config import GRPOConfig
    from tclightning.grpo.update import grpo_update
    from tclightning.pipeline.backends import PipelineBackend
    from tclightning.pipeline.engine import PipelineEngine

    model = tiny_llama()
    engine = PipelineEngine(model, config_for("prf-1f1b"))
    backend = PipelineBackend(sampling_request(model), engine)
    names = {id(p): name for name, p in model.named_parameters()}
    mine = engine.stage_parameters(rank)
    optimizer = torch.optim.AdamW(backend.owned_parameters(), lr=1.0)
    fixed = SimpleNamespace(step=lambda: None)  # the test sets the learning rate itself

    def update(lr: float) -> dict[str, float]:
        for group in optimizer.param_groups:
            group["lr"] = lr
        before = [p.detach().to(BF16) for p in mine]
        backend.begin_step(STEP)
        grpo_update(backend, optimizer, fixed, rollouts(), ADVANTAGES, torch.arange(6), cfg=GRPOConfig(minibatches=2),
                    norm_length=4, seed=0, step=STEP)
        wire = backend.wire_metrics()
        return {**wire, "expected": expected_bytes(before, [p.detach().to(BF16) for p in mine])}

    def cast_bits() -> dict[str, Any]:
        """This rank's stage cast to bfloat16 and, on rank 0, the sampler's copy (bit patterns, by name)."""
        copy = None
        if rank == 0:
            copy = {name: bits(p.detach()).clone() for name, p in backend.sampling_model().named_parameters()}
        return {"own": {names[id(p)]: bits(p.detach().to(BF16)) for p in mine}, "copy": copy}

    start = cast_bits()["own"]
    steps = [update(lr) for lr in lrs]
    synced = cast_bits()
    engine.sync_before_checkpoint()  # what the strategy does before Lightning takes the state dict
    held = model.named_parameters() if rank == 0 else ((names[id(p)], p) for p in mine)
    checkpoint = {name: p.detach().clone() for name, p in held}
    backend.begin_step(STEP)
    carried = backend.wire_metrics()
    model.load_state_dict(tiny_llama(seed=5).state_dict())  # a rollback: every rank loads the same weights
    backend.weights_loaded()
    after_rollback = update(1e-6)
    return {"steps": steps, "start": start, "synced": synced, "checkpoint": checkpoint, "carried": carried,
            "after_rollback": after_rollback, "final": cast_bits(),
            "stage_numel": [sum(p.numel() for p in engine.stage_parameters(i)) for i in range(world_size)],
            "samples_from_copy": next(backend.sampling_model().parameters()).dtype == BF16}


@pytest.fixture(scope="module")
def two_ranks() -> tuple[dict[str, Any], dict[str, Any]]:
    outcomes = run_ranks(two_rank_worker, 2, [1e-6, 1e-6, 1e-6, 1e-2, 1e-6], timeout_s=60)
    for outcome in outcomes:
        assert outcome.error is None, outcome.trace
    return outcomes[0].value, outcomes[1].value


def check_copy(first: dict[str, Any], last: dict[str, Any]) -> None:
    """Rank 0's copy equals every rank's own stage cast to bfloat16, bit for bit."""
    copy = first["copy"]
    for rank_state in (first["own"], last["own"]):
        for name, want in rank_state.items():
            assert torch.equal(copy[name], want), name
    assert set(copy) == set(first["own"]) | set(last["own"])


def test_two_ranks_keep_the_sampler_copy_exact_and_count_the_formula(two_ranks: Any) -> None:
    first, last = two_ranks
    assert first["samples_from_copy"] and not last["samples_from_copy"]
    check_copy(first["synced"], last["synced"])
    check_copy(first["final"], last["final"])
    full = last["stage_numel"][1] * 2
    for got, mine in zip(first["steps"] + [first["after_rollback"]], last["steps"] + [last["after_rollback"]]):
        assert got["wire/sync_bytes"] == mine["wire/sync_bytes"] == mine["expected"]  # rank 1 sends, all-reduced
        assert got["wire/sync_share"] == got["wire/sync_bytes"] / full
    shares = [step["wire/sync_share"] for step in first["steps"]]
    assert 0 < min(shares[:3]) and max(shares[:3]) < 0.2 and shares[3] > shares[0], shares  # lr 1e-2: most entries move
    # rank 1's stage moved away from where it started, and its sends are what brought the copy along
    assert any(not torch.equal(first["synced"]["copy"][name], value) for name, value in last["start"].items())


def test_a_checkpoint_after_sparse_syncs_holds_the_current_float32_weights(two_ranks: Any) -> None:
    first, last = two_ranks
    for name, weight in last["checkpoint"].items():
        assert torch.equal(first["checkpoint"][name], weight), name
    # the full float32 sync is counted in the next step's wire/sync_bytes
    assert first["carried"]["wire/sync_bytes"] == last["carried"]["wire/sync_bytes"] == last["stage_numel"][1] * 4


@pytest.mark.slow
def test_a_two_process_run_with_a_float32_copy_equals_the_dense_sync_and_resumes(tmp_path: Path) -> None:
    """Through Lightning, 2 processes: ``sampler.dtype=float32`` (sparse sync into an exact float32
    copy) trains exactly as the dense sync does, its checkpoints hold the same weights (the full
    sync before each), and a resume from step 1 rebuilds the copy from the restored weights and
    ends with the same weights again."""
    import os
    import subprocess
    import sys

    from tclightning.grpo.summary import read_metrics

    repo = Path(__file__).resolve().parents[1]
    base = [sys.executable, "-m", "tclightning", "run", "--recipe", "tiny", "--quiet"]
    common = ["trainer.strategy=pipeline", "trainer.devices=2", "trainer.accelerator=cpu", "pipeline.stages=2",
              "pipeline.layout=all", "pipeline.k=8", "trainer.val_every=0", "trainer.checkpoint_every=1",
              "trainer.keep_checkpoints=3", "model.warmup.steps=0", "logging.progress=none", "trainer.num_threads=1",
              "grpo.prompts_per_step=4", "sampler.group_size=4", "sampler.max_new_tokens=8", "grpo.overlong=1.0"]
    env = {**os.environ, "PYTHONPATH": str(repo)}

    def launch(where: Path, extra: list[str], resume: Path | None = None) -> Path:
        where.mkdir(exist_ok=True)
        args = [*base, *(["--resume", str(resume)] if resume else []), *common, *extra]
        done = subprocess.run(args, check=False, cwd=where, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        (run_dir,) = (where / "runs" / "tiny").iterdir()
        return run_dir

    dense = launch(tmp_path / "dense", ["trainer.steps=3"])
    sparse = launch(tmp_path / "sparse", ["trainer.steps=3", "sampler.dtype=float32"])
    want, got = read_metrics(dense / "metrics.csv"), read_metrics(sparse / "metrics.csv")
    assert sorted(got) == sorted(want) == [0, 1, 2]
    for step in want:
        for key in ("reward/mean", "loss/policy", "policy/grad_norm", "wire/bytes_fwd"):
            assert got[step][key] == want[step][key], (step, key)
        assert got[step]["wire/sync_bytes"] > 0 and "wire/sync_share" in got[step]
    for name in ("step-000001.ckpt", "last.ckpt"):
        dense_weights = torch.load(dense / "checkpoints" / name, weights_only=False)["state_dict"]
        sparse_weights = torch.load(sparse / "checkpoints" / name, weights_only=False)["state_dict"]
        for key, weight in dense_weights.items():
            assert torch.equal(sparse_weights[key], weight), (name, key)
    final = torch.load(sparse / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    launch(tmp_path / "sparse", ["trainer.steps=3", "sampler.dtype=float32"],
           resume=sparse / "checkpoints" / "step-000001.ckpt")
    resumed = torch.load(sparse / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    for key, weight in final.items():
        assert torch.equal(resumed[key], weight), key
