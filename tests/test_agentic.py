"""Agentic multi-turn training: the calculator environment's rules, the rows a multi-turn rollout
builds (prompts = history, completions, masks, shared advantages), and the recipes end to end."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from tclightning.agentic import (
    CalculatorEnv,
    CalculatorTask,
    Transcript,
    build_agentic_task,
    demonstration_pairs,
    replay,
)
from tclightning.agentic.calculator import chain_problem, parse_action
from tclightning.agentic.rollout import (
    ConversationFormatter,
    MultiTurnRollout,
    cat_rows,
)
from tclightning.errors import TclightningError
from tclightning.grpo.advantages import group_advantages
from tclightning.models.logprobs import completion_logps
from tclightning.grpo.loss import gap_by_turn
from tclightning.grpo.module import GRPOModule
from tclightning.grpo.summary import read_metrics
from tclightning.models.char_tokenizer import build_char_tokenizer
from tclightning.models.config import TinyModelConfig
from tclightning.models.loading import build_tiny_model
from tclightning.models.warmup import sft_batch
from tclightning.run import run
from tclightning.sampling.base import PromptFormatter, Rollouts
from tclightning.tasks.base import Example
from tclightning.tasks.config import TaskConfig
from tests.conftest import FAST
from tests.test_docs import undocumented


def calculator(**overrides) -> CalculatorTask:
    settings = {"name": "calculator", "operations": "+*", "eval_size": 8, "num_train": 32, **overrides}
    return build_agentic_task(TaskConfig(**settings))  # type: ignore[return-value]


# ----------------------------------------------------------------------------- environment rules
@pytest.mark.parametrize(
    ("action", "parsed"),
    [
        ("calc:12*7", ("calc", 12, "*", 7)),
        (" calc: 12 + 7 ", ("calc", 12, "+", 7)),
        ("calc:-3-4", ("calc", -3, "-", 4)),
        ("answer:84", ("answer", 84)),
        ("answer: 84\n", ("answer", 84)),
        ("calc:12*7*2", None),  # one operation per call
        ("calc:12/7", None),
        ("answer:", None),
        ("answer:84 done", None),
        ("84", None),
        ("calc:" + "9" * 31 + "*2", None),  # runaway digit strings are not evaluated
        ("answer:\u0668\u0664", None),  # other scripts' digits are not numbers (int() reads them)
        ("calc:\uff11\uff12*7", None),
        (None, None),  # not text at all
    ],
)
def test_parse_action(action: str, parsed: tuple | None) -> None:
    assert parse_action(action) == parsed


def test_calculator_env_rules() -> None:
    env = CalculatorEnv("(12*7)+3", 87)
    assert env.reset() == "(12*7)+3\n"
    tool = env.step("calc:12*7")
    assert (tool.observation, tool.reward, tool.done, tool.info["tool"], tool.info["valid"]) == ("=84\n", 0.0, False, True, True)
    bad = env.step("what is it")
    assert (bad.observation, bad.reward, bad.done, bad.info["valid"]) == ("invalid\n", 0.0, False, False)
    wrong = env.step("answer:86")
    assert (wrong.reward, wrong.done, wrong.info["success"]) == (0.0, True, False)
    right = CalculatorEnv("(12*7)+3", 87).step("answer: 87")
    assert (right.observation, right.reward, right.done, right.info["success"]) == ("right\n", 1.0, True, True)


def test_chain_problem_and_its_expert() -> None:
    assert chain_problem([12, 7, 3], ["*", "+"]) == ("(12*7)+3", 87, ["calc:12*7", "calc:84+3", "answer:87"])
    assert chain_problem([5, 9], ["-"]) == ("5-9", -4, ["calc:5-9", "answer:-4"])
    transcript = replay(CalculatorEnv("(12*7)+3", 87), ["calc:12*7", "calc:84+3", "answer:87"])
    assert transcript.success and transcript.rewards == [0.0, 0.0, 1.0] and transcript.turns == 3
    assert [m["content"] for m in transcript.history(2)] == ["(12*7)+3\n", "calc:12*7", "=84\n", "calc:84+3", "=87\n"]


def test_calculator_task_is_deterministic_disjoint_and_its_demonstrations_solve_it() -> None:
    task = calculator()
    again = calculator(num_train=16)
    assert [e.prompt for e in task.eval_examples()] == [e.prompt for e in again.eval_examples()]  # eval set fixed
    assert len(task.train_examples()) == 32 and len(task.eval_examples()) == 8
    assert not {e.prompt for e in task.train_examples()} & {e.prompt for e in task.eval_examples()}
    histories, actions = demonstration_pairs(task, task.train_examples())
    assert len(actions) == 3 * 32  # chain 2: two tool calls and the answer per problem
    assert actions[:3] == task.demonstration(task.train_examples()[0])
    assert [len(h) for h in histories[:3]] == [1, 3, 5]  # the history grows by (action, observation)
    with pytest.raises(TclightningError, match="max_turns"):
        calculator(chain=3, max_turns=3)
    with pytest.raises(TclightningError, match="operations"):
        calculator(operations="/")


# ----------------------------------------------------------------------------- formatting and rows
@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def test_conversation_formatter(tokenizer) -> None:
    history = [{"role": "user", "content": "(1+2)*3\n"}, {"role": "assistant", "content": "calc:1+2"},
               {"role": "user", "content": "=3\n"}]
    templated = ConversationFormatter(tokenizer, None, True)
    assert templated.render(history) == "(1+2)*3\ncalc:1+2</s>=3\n"
    assert templated.render("7+8=") == PromptFormatter(tokenizer, None, True).render("7+8=")
    with_system = ConversationFormatter(tokenizer, "play", True)
    assert with_system.render(history) == "play\n(1+2)*3\ncalc:1+2</s>=3\n"
    raw = ConversationFormatter(tokenizer, "play", False)
    assert raw.render(history) == "play\n(1+2)*3\ncalc:1+2</s>=3\n"
    # Warm-up rows: labels on the expert action and its eos only, after the rendered history.
    batch = sft_batch(templated, [history], ["calc:3*3"])
    labelled = batch["labels"][0][batch["labels"][0] != -100]
    assert tokenizer.decode(labelled) == "calc:3*3</s>"
    assert tokenizer.decode(batch["input_ids"][0][: (batch["labels"][0] == -100).sum()]) == templated.render(history)


class ScriptedSampler:
    """A ``Sampler`` whose replies are scripted per call (one list per turn, in the order of the
    still-running conversations); log-prob of reply token j is ``-(call + 1) * (j + 1) / 100``."""

    def __init__(self, formatter: ConversationFormatter, calls: list[list[str]]) -> None:
        self.formatter, self.calls, self.prompts = formatter, calls, []

    def generate(self, model, prompts: Sequence, *, group_size: int, seed: int, greedy: bool = False,
                 max_new_tokens: int | None = None) -> Rollouts:
        call = len(self.prompts)
        replies = self.calls[call]
        assert group_size == 1 and len(replies) == len(prompts)
        self.prompts.append([self.formatter.render(p) for p in prompts])
        tok = self.formatter.tokenizer
        encoded = self.formatter.encode(prompts)
        ids = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in replies]
        width = max(map(len, ids))
        completion = torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i in ids])
        mask = torch.tensor([[1.0] * len(i) + [0.0] * (width - len(i)) for i in ids])
        logp = -(call + 1) * torch.arange(1, width + 1).float().expand(len(ids), width) / 100 * mask
        return Rollouts(encoded["input_ids"], encoded["attention_mask"], completion, mask, logp, list(replies),
                        torch.zeros(len(ids), dtype=torch.bool), 1)


QUESTION_A, QUESTION_B = Example("a", "(12*7)+3", "87", ""), Example("b", "(2+3)*4", "20", "")
# Four trajectories, G = 2 per instance: A solves / A answers wrong at once / B fumbles once then
# solves in 4 / B never makes a valid move and is cut off at max_turns = 4.
SCRIPT = {
    0: ["calc:12*7", "calc:84+3", "answer:87"],
    1: ["answer:5"],
    2: ["hm", "calc:2+3", "calc:5*4", "answer:20"],
    3: ["?", "?", "?", "?"],
}


def scripted_episodes(tokenizer):
    formatter = ConversationFormatter(tokenizer, None, True)
    calls = [[SCRIPT[0][0], SCRIPT[1][0], SCRIPT[2][0], SCRIPT[3][0]],
             [SCRIPT[0][1], SCRIPT[2][1], SCRIPT[3][1]],
             [SCRIPT[0][2], SCRIPT[2][2], SCRIPT[3][2]],
             [SCRIPT[2][3], SCRIPT[3][3]]]
    sampler = ScriptedSampler(formatter, calls)
    rollout = MultiTurnRollout(calculator(), sampler, tokenizer.pad_token_id, max_turns=4)
    return rollout.play(None, [QUESTION_A, QUESTION_B], group_size=2, seed=0), sampler, formatter


def test_multi_turn_rows_are_history_prompts_and_replies(tokenizer) -> None:
    episodes, sampler, formatter = scripted_episodes(tokenizer)
    assert len(sampler.prompts) == 4  # one generate call per turn, for the conversations still running
    assert episodes.trajectory.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    assert episodes.turn.tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 0, 1, 2, 3]
    assert episodes.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    rows = episodes.rows
    assert rows.num_sequences == 12
    for b, (k, turn) in enumerate(zip(episodes.trajectory.tolist(), episodes.turn.tolist())):
        prompt = tokenizer.decode(rows.prompt_ids[b][rows.prompt_mask[b].bool()])
        assert prompt == formatter.render(episodes.transcripts[k].history(turn))
        assert bool(rows.prompt_mask[b][-1]) and not bool(rows.prompt_mask[b][: -int(rows.prompt_mask[b].sum())].any())
        reply = SCRIPT[k][turn]
        n = len(reply) + 1  # the reply and its eos
        assert rows.texts[b] == reply
        assert rows.completion_mask[b].sum() == n and rows.completion_mask[b][:n].all()
        assert tokenizer.decode(rows.completion_ids[b][:n]) == reply + "</s>"
        expected = -(turn + 1) * torch.arange(1, n + 1).float() / 100  # turn t was call t
        assert torch.allclose(rows.logp_sampler[b][:n], expected) and not rows.logp_sampler[b][n:].any()
    # the prompt of A's second and third interactions, by hand
    assert tokenizer.decode(rows.prompt_ids[1][rows.prompt_mask[1].bool()]) == "(12*7)+3\ncalc:12*7</s>=84\n"
    assert tokenizer.decode(rows.prompt_ids[2][rows.prompt_mask[2].bool()]) == \
        "(12*7)+3\ncalc:12*7</s>=84\ncalc:84+3</s>=87\n"
    assert tokenizer.decode(rows.prompt_ids[5][rows.prompt_mask[5].bool()]) == "(2+3)*4\nhm</s>invalid\n"


def test_multi_turn_advantages_are_shared_by_a_trajectorys_rows(tokenizer) -> None:
    episodes, _, _ = scripted_episodes(tokenizer)
    # Each group is {1, 0}: mean 0.5, unbiased std sqrt(0.5), so A = +-0.5 / (sqrt(0.5) + eps).
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    row_advantages = group_advantages(episodes.rewards, 2, "group", 1e-4)[episodes.trajectory]
    expected = [a, a, a, -a, a, a, a, a, -a, -a, -a, -a]
    assert row_advantages.tolist() == pytest.approx(expected, rel=1e-6)


def test_episode_metrics(tokenizer) -> None:
    metrics = scripted_episodes(tokenizer)[0].metrics()
    assert metrics == pytest.approx({
        "agentic/success_rate": 0.5,
        "agentic/interactions_mean": (3 + 1 + 4 + 4) / 4,
        "agentic/interactions_max": 4.0,
        "agentic/unfinished_frac": 0.25,  # trajectory 3 was cut off
        "agentic/reward_trajectory": 0.5,
        "agentic/reward_interaction": 2 / 12,
        "agentic/valid_frac": 7 / 12,  # "hm" and the four "?" are malformed
        "agentic/tool_calls_mean": 4 / 4,
    })


def test_cat_rows_keeps_each_rows_log_probs(tokenizer) -> None:
    """Rows of different prompt and completion widths stacked into one batch: the trainer's
    log-probs of every row are those of the row alone (padding is invisible)."""
    episodes = scripted_episodes(tokenizer)[0]
    model = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64), tokenizer).eval()
    parts = [episodes.rows.select(torch.tensor([b])) for b in (0, 2, 7)]
    stacked = cat_rows(parts, tokenizer.pad_token_id)
    assert stacked.prompt_ids.shape[1] == max(p.prompt_ids.shape[1] for p in parts)
    with torch.no_grad():
        together, _ = completion_logps(model, stacked)
        for i, part in enumerate(parts):
            alone, _ = completion_logps(model, part)
            width = alone.shape[1]
            assert torch.allclose(together[i, :width], alone[0], atol=1e-5)
            assert not together[i, width:].any()


def test_gap_by_turn() -> None:
    sampler = torch.full((3, 2), -1.0)
    trainer = sampler.clone()
    trainer[1:] += 0.5  # rows of turn 1 are off by half a nat, turn 0 exact
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    gap = gap_by_turn(trainer, sampler, mask, torch.tensor([0, 1, 1]))
    assert gap["agentic/gap_kl_turn0"] == 0.0 and gap["agentic/gap_abs_turn0"] == 0.0
    # float32 exp against float64 math: 3.5e-7 off even correctly rounded, so the default 1e-6
    # would fail on an exp kernel one ulp away; 1e-5 still catches any wrong formula
    assert gap["agentic/gap_kl_turn1"] == pytest.approx(math.exp(0.5) - 1.5, rel=1e-5)
    assert gap["agentic/gap_abs_turn1"] == pytest.approx(0.5)


def test_transcript_unfinished_is_not_a_success() -> None:
    transcript = Transcript("q\n")
    transcript.record("calc:1+1", CalculatorEnv("1+1", 2).step("calc:1+1"))
    assert not transcript.done and not transcript.success and transcript.total_reward == 0.0


# ----------------------------------------------------------------------------- end to end
AGENTIC_FAST = [*FAST, "trainer.steps=2", "trainer.val_every=1", "pipeline.stages=2", "anchor.latency=1",
                "anchor.cadence=1", "sampler.max_new_tokens=6", "model.warmup.steps=4", "model.warmup.batch_size=8",
                "model.warmup.check_every=2", "task.eval_size=4"]


@pytest.fixture()
def spy(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Records, per RL step, what ``collect`` returned and the advantages ``_update`` trained on."""
    steps: list[dict] = []
    collect, update = GRPOModule.collect, GRPOModule._update

    def spy_collect(self, *args, **kwargs):
        out = collect(self, *args, **kwargs)
        steps.append({"collected": out})
        return out

    def spy_update(self, rollouts, advantages, rows, step, turns=None):
        steps[-1].update(advantages=advantages.clone(), turns=turns, rows=rows)
        return update(self, rollouts, advantages, rows, step, turns)

    monkeypatch.setattr(GRPOModule, "collect", spy_collect)
    monkeypatch.setattr(GRPOModule, "_update", spy_update)
    return steps


@pytest.mark.parametrize("recipe", ["agentic-dense", "agentic-shallow"])
def test_agentic_recipe_runs_end_to_end(run_root: Path, spy: list[dict], recipe: str) -> None:
    summary = run(recipe, AGENTIC_FAST, quiet=True)
    rows = read_metrics(Path(summary["run_dir"]) / "metrics.csv")
    assert sorted(rows) == [0, 1]
    logged = set().union(*rows.values())
    assert undocumented(logged) == set()
    for key in ("agentic/success_rate", "agentic/interactions_mean", "agentic/reward_trajectory",
                "agentic/reward_interaction", "agentic/valid_frac", "agentic/gap_kl_turn0", "val/accuracy"):
        assert key in logged, key
    # The update trained on interaction rows whose advantages are their trajectory's.
    trained = [s for s in spy if "advantages" in s]
    assert len(trained) == 2
    for step in trained:
        rollouts, rewards, owner, episodes = step["collected"]
        assert episodes is not None and rollouts.num_sequences == len(owner) > len(rewards) == 4 * 4
        expected = group_advantages(rewards, 4, "group", 1e-4)[owner]
        assert torch.allclose(step["advantages"].cpu(), expected)
        assert torch.equal(step["turns"], episodes.turn)
    gap = max(r["agentic/gap_kl_turn0"] for r in rows.values() if "agentic/gap_kl_turn0" in r)
    if recipe == "agentic-dense":
        assert gap < 1e-6  # dense: sampler and trainer agree
        assert "wire/ratio" in logged and rows[0]["wire/ratio"] == pytest.approx(1.0)
    else:
        assert gap > 1e-4  # the compressed shallow cut opens the gap from the first interaction on
        assert rows[0]["wire/ratio"] > 1.0 and "anchor/sign_agreement" in logged


def test_the_gap_per_interaction_is_logged_in_one_process_and_across_two(run_root: Path) -> None:
    """The per-interaction gap (``agentic/gap_*_turn{i}``) comes from the one update loop, so an
    agentic run logs it with one stage per process too, with the one-process values: the same
    seed samples the same conversations on rank 0, and the last stage's log-probs equal the
    one-process cuts' (tests/test_distributed.py)."""
    import os
    import subprocess
    import sys

    settings = [*AGENTIC_FAST, "trainer.steps=1", "trainer.val_every=0", "trainer.accelerator=cpu"]
    one = read_metrics(Path(run("agentic-shallow", settings, quiet=True)["run_dir"]) / "metrics.csv")[0]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    args = [sys.executable, "-m", "tclightning", "run", "--recipe", "agentic-shallow", "--quiet", *settings,
            "trainer.devices=2", "logging.name=two-processes"]
    done = subprocess.run(args, check=False, cwd=run_root.parent, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (run_root / "two-processes").iterdir()
    two = read_metrics(run_dir / "metrics.csv")[0]
    turns = sorted(k for k in one if k.startswith(("agentic/gap_kl_turn", "agentic/gap_abs_turn")))
    assert "agentic/gap_kl_turn0" in turns and "agentic/gap_kl_turn1" in turns  # several interactions
    assert sorted(k for k in two if k.startswith(("agentic/gap_kl_turn", "agentic/gap_abs_turn"))) == turns
    for key in turns:
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
