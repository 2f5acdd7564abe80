"""Every bad input: one line on stderr naming the key or file, exit code 2, no traceback, nothing written.

Table-driven through the real CLI entry point (``tclightning.cli.main.main``, in-process: the same
argument parsing, handlers and error printing as the ``tclightning`` command, without a Python
start per case). Each case runs in an empty temporary folder with ``logging.root`` inside it; after
the error the folder must hold exactly the inputs the case wrote. Validation runs before any model
is built, so each case costs a fraction of a second once the imports are warm.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tclightning.cli.main import main
from tclightning.recipes.loader import find_recipe, list_recipes
from tclightning.recipes.ranges import RULES, leaf_keys
from tclightning.recipes.schema import RecipeConfig
from tclightning.settings import settings



@dataclass(frozen=True)
class Case:
    """A bad input: ``argv`` after ``tclightning`` ({tmp} is the case's folder), the ``files`` the case
    writes there first (name -> bytes), and ``names``: text the one error line must contain."""

    argv: tuple[str, ...]
    names: tuple[str, ...]
    files: dict[str, bytes] = field(default_factory=dict)


def override(*overrides: str, names: tuple[str, ...] = ()) -> Case:
    """``run --recipe tiny`` with overrides: the error is credited to the (last) override."""
    return Case(("run", "--recipe", "tiny", "logging.root={tmp}/runs", *overrides),
                names or (f"command line: override '{overrides[-1]}'",))


def recipe(text: str | bytes, *names: str) -> Case:
    """``run --recipe {tmp}/bad.yaml``: the error names the file (and the key, in ``names``)."""
    data = text.encode() if isinstance(text, str) else text
    return Case(("run", "--recipe", "{tmp}/bad.yaml"), ("bad.yaml", *names), {"bad.yaml": data})


BASE = "defaults: [tiny]\ndescription: x\nlogging: {root: runs}\n"
NO_PRESETS = BASE + "callback_presets: []\n"  # the recipe's own callbacks are callbacks[0], ...

CASES: dict[str, Case] = {
    # --- issue 14, point 8: tracebacks before
    "lr-negative": override("grpo.lr=-1"),
    "lr-nan": override("grpo.lr=nan"),
    "temperature-zero": override("sampler.temperature=0"),
    "temperature-denormal": override("sampler.temperature=1e-45"),  # sampling failed inside generate
    "warmup-lr-past-float32": override("model.warmup.lr=1e39"),  # the warm-up's first AdamW step failed
    "num-threads-negative": override("trainer.num_threads=-1"),
    "devices-zero": override("trainer.devices=0"),
    "num-nodes-past-any-cluster": override("trainer.num_nodes=2147483648"),  # torch's rendezvous raised on it
    "heads-do-not-divide": override("model.tiny.num_heads=3"),
    "hidden-size-zero": override("model.tiny.hidden_size=0"),
    # OmegaConf reads "on", "yes", "1" or 1 as true for a switch (trust_remote_code runs a folder's code)
    "flag-given-a-word": override("model.trust_remote_code=enabled", names=("trust_remote_code=enabled", "expected true or false")),
    "flag-given-a-quoted-true": override('model.trust_remote_code="true"'),
    "flag-given-a-number": override("task.reverse_answer=1"),
    "file-flag-given-on": recipe(BASE + 'model: {trust_remote_code: "on"}\n', "model.trust_remote_code", "expected true or false"),
    # every size in its range, together 1024 layers of width 4096: 206 G parameters, allocated before
    "tiny-model-past-any-memory": override("model.tiny.hidden_size=4096", "model.tiny.num_layers=1024",
                                           "model.tiny.intermediate_size=16384",
                                           names=("model.tiny.hidden_size", "parameters, more than")),
    "betas-one-value": override("grpo.betas=[0.9]"),
    "seed-too-large": override("trainer.seed=99999999999"),
    "recipe-not-utf8": recipe(b"description: caf\xe9\n", "not UTF-8"),
    "override-not-utf8": override("grpo.lr=\udcff", names=("command line", "not valid UTF-8", "grpo.lr")),
    # the pipeline section is read by the pipeline strategy only: set without it, it would do nothing
    "pipeline-layout-without-the-pipeline-strategy": override("pipeline.layout=all", names=(
        "pipeline.layout=all", "trainer.strategy=pipeline")),
    "pipeline-stages-without-the-pipeline-strategy": override("pipeline.stages=100", names=(
        "pipeline.stages=100", "trainer.strategy=pipeline")),
    "lora-no-target-modules": override("model.lora.r=8", "model.lora.target_modules=[]", names=(
        "model.lora.target_modules=[]", "at least one value")),
    # a name past the filesystem's 255 bytes: the operating system's refusal, as one line
    "recipe-path-name-too-long": Case(("recipes", "show", "{tmp}/" + "a" * 300 + ".yaml"),
                                      ("longer than the filesystem allows",)),
    "logging-root-name-too-long": override("logging.root={tmp}/" + "a" * 300, names=(
        "longer than the filesystem allows",)),
    # every prompt holds these: past the model's positions on their own, or past their size, at once
    "system-prompt-past-the-positions": override("model.warmup.steps=0", "task.system_prompt=" + "x" * 10_000, names=(
        "the system prompt and chat template alone",)),
    "instruction-too-long": override("task.instruction=" + "x" * 40_000, names=("task.instruction", "at most 32768 characters")),
    # YAML 1.1 numbers a reader would not see: 010 is 8, 1:30 is 90
    "override-line-break": override("logging.root={tmp}/a\nb", names=("/a\\nb'", "holds a line break")),
    "override-carriage-return": override("logging.name=a\rb", names=("holds a line break",)),
    "override-octal-number": override("trainer.steps=010", names=("trainer.steps=010", "octal number 8")),
    "file-base-60-number": recipe(BASE + "trainer: {steps: 1:30}\n", "base-60 number"),
    "override-integer-past-4300-digits": override("trainer.seed=1" + "0" * 5000, names=("trainer.seed=1", "a number of 5001 characters")),
    # hex converts at any length, then has more decimal digits than Python prints (a range message)
    "override-hex-integer-of-5000-digits": override("trainer.steps=0x" + "f" * 5000,
                                                   names=("trainer.steps=0x", "a number of 5002 characters")),
    "override-float-key-integer-past-any-float": override("grpo.lr=1" + "0" * 400,
                                                         names=("grpo.lr=1", "integer of 1329 bits, past any float")),
    # a metric a rule reads that is not a number, a row of fewer cells, a step in other digits, a
    # file longer than a replay takes, a header of 200k columns (quadratic to check once)
    "analyze-health-text-in-a-metric": Case(("analyze", "health", "{tmp}/m.csv"), ("m.csv:2", "reward/mean 'hello'"),
                                            {"m.csv": b"step,reward/mean,loss\n0,hello,1\n1,hello,2\n"}),
    "analyze-health-short-row": Case(("analyze", "health", "{tmp}/m.csv"), ("m.csv:3", "2 cells where the header"),
                                     {"m.csv": b"step,reward/mean,loss\n0,0.5,1\n1,0.5\n"}),
    "analyze-health-fullwidth-step": Case(("analyze", "health", "{tmp}/m.csv"), ("m.csv:2", "is not a number"),
                                          {"m.csv": "step,reward/mean\n\uff11,0.5\n".encode()}),
    # float() reads "1_0" as 10
    "analyze-health-underscore-in-a-metric": Case(("analyze", "health", "{tmp}/m.csv"), ("m.csv:3", "reward/mean '1_0'"),
                                                  {"m.csv": b"step,reward/mean\n0,0.5\n1,1_0\n"}),
    "analyze-health-underscore-in-a-step": Case(("analyze", "health", "{tmp}/m.csv"), ("m.csv:2", "step '1_0'"),
                                                {"m.csv": b"step,reward/mean\n1_0,0.5\n"}),
    "analyze-health-too-many-rows": Case(("analyze", "health", "{tmp}/m.csv"), ("m.csv", "more than 250000 rows"),
                                         {"m.csv": b"step,reward/mean\n" + b"0,0.5\n" * 250_001}),
    # the csv reader ends a row at a bare \r too (old Mac line ends): the count was of \n alone
    "analyze-health-too-many-rows-cr": Case(("analyze", "health", "{tmp}/m.csv"), ("m.csv", "more than 250000 rows"),
                                            {"m.csv": b"step,reward/mean\r" + b"0,0.5\r" * 250_001}),
    # a header past the 1 MiB the count reads at a time: its width was read from the second read only
    "analyze-health-header-past-a-read": Case(("analyze", "health", "{tmp}/m.csv"), ("m.csv", "cells"), {
        "m.csv": ("step," + ",".join(f"column{i:07d}" for i in range(140_000)) + "\n"
                  + ("0," + "," * 139_999 + "\n") * 80).encode()}),
    "analyze-health-200k-columns": Case(("analyze", "health", "{tmp}/m.csv"), ("m.csv", "no metric columns"), {
        "m.csv": ("step," + ",".join(f"c{i}" for i in range(200_000)) + "\n0," + ",".join("1" * 200_000) + "\n").encode()}),
    # a header of 100k columns over 101 rows: ten million cells to parse (counted before parsing)
    "analyze-health-too-many-cells": Case(("analyze", "health", "{tmp}/m.csv"), ("m.csv", "10,000,000 cells"), {
        "m.csv": ("step," + ",".join(f"c{i}" for i in range(100_000)) + "\n").encode() + b"0\n" * 101}),
    # the same after a byte-order mark and blank lines: counted as 1 column, the count was passed
    "analyze-health-too-many-cells-after-blank-lines": Case(
        ("analyze", "health", "{tmp}/m.csv"), ("m.csv", "10,000,000 cells"),
        {"m.csv": b"\xef\xbb\xbf\n \r\n" + ("step," + ",".join(f"c{i}" for i in range(100_000)) + "\n").encode()
         + b"0\n" * 101}),
    # more trajectory points than analysed (counted before any is read)
    "analyze-trajectory-too-many-points": Case(("analyze", "trajectory", "{tmp}/t", "--out", "{tmp}/o"),
                                               ("2001 trajectory points", "2000"),
                                               {f"t/point-{i:06d}.pt": b"" for i in range(2001)}),
    # past what a float32 parameter holds (the optimizer's first step overflowed); a codec budget
    # that buys no coefficient; a two-node link the shaper cannot make, no time, no process
    "lr-past-float32": override("grpo.lr=1e39", names=("grpo.lr=1e39",)),
    "pipeline-timeout-past-the-clock": override("trainer.strategy=pipeline", "pipeline.stages=2", "trainer.devices=2",
                                                "pipeline.timeout_s=1e15", names=("pipeline.timeout_s=1e15",)),
    # autocast cannot take float16 weights (a traceback in the first step)
    "float16-weights-with-mixed-precision": override("model.dtype=float16", "trainer.precision=bf16-mixed",
                                                     names=("trainer.precision=bf16-mixed", "cannot be autocast")),
    "bench-codec-budget-buys-no-coefficient": Case(
        ("bench", "codec", "--tokens", "16", "--k", "1", "--repeats", "1", "--codec", "lowrank-4bit"),
        ("bench codec --codec lowrank-4bit", "4-bit")),
    "bench-two-node-mbit-zero": Case(("bench", "two-node", "--dir", "{tmp}/n", "--mbit", "0"), ("--mbit", "got 0.0")),
    "bench-two-node-mbit-nan": Case(("bench", "two-node", "--dir", "{tmp}/n", "--mbit", "nan"), ("--mbit", "got nan")),
    "bench-two-node-timeout-zero": Case(("bench", "two-node", "--dir", "{tmp}/n", "--timeout", "0"), ("--timeout",)),
    "bench-two-node-no-process": Case(("bench", "two-node", "--dir", "{tmp}/n", "--per-node", "0"), ("--per-node",)),
    "bench-step-link-dir-a-file": Case(("bench", "step-link", "--recipe", "tiny", "--dir", "{tmp}/afile"),
                                       ("--dir", "is a file, not a folder"), {"afile": b"x"}),
    "bench-step-link-timeout-zero": Case(("bench", "step-link", "--recipe", "tiny", "--timeout", "0"), ("--timeout",)),
    # 255 namespaces were made before the 256th address failed, a traceback
    "bench-step-link-stages-huge": Case(("bench", "step-link", "--recipe", "tiny", "--stages", "300"), ("--stages",)),
    "bench-two-node-dir-under-proc": Case(("bench", "two-node", "--dir", "/proc/tcl-nowhere"), ("--dir", "cannot make")),
    # /proc/self is a folder no file can be made in: the node's log was a traceback
    "bench-two-node-dir-proc-self": Case(("bench", "two-node", "--dir", "/proc/self"), ("--dir", "cannot write in")),
    "bench-step-link-dir-proc-self": Case(("bench", "step-link", "--recipe", "tiny", "--dir", "/proc/self"),
                                          ("--dir", "cannot write in")),
    "bench-step-link-dir-under-proc": Case(("bench", "step-link", "--recipe", "tiny", "--dir", "/proc/self/x"),
                                           ("--dir", "cannot make")),
    "callbacks-an-empty-entry": recipe(BASE + "callbacks: [{}]\n", "class_path'", "needs a class_path"),
    "callbacks-a-mapping": recipe(BASE + "callbacks: {class_path: x}\n", "key 'callbacks'", "expected a list"),
    "betas-a-mapping": override("grpo.betas={a: 1}", names=("grpo.betas", "expected a list")),
    "bench-two-node-dir-a-file": Case(("bench", "two-node", "--dir", "{tmp}/afile"), ("--dir", "is a file, not a folder"),
                                      {"afile": b"x"}),
    "bench-two-node-dir-under-a-file": Case(("bench", "two-node", "--dir", "{tmp}/afile/sub"), ("is a file, not a folder",),
                                            {"afile": b"x"}),
    "bench-traffic-config-negative-width": Case(
        ("bench", "traffic", "--recipe", "tiny", "--model-config", "{tmp}/c.json"), ("hidden_size -64",),
        {"c.json": b'{"model_type": "llama", "num_hidden_layers": 4, "hidden_size": -64}'}),
    # datasets' own log line and progress bars came first, and the line named a private view of the file
    "task-csv-not-utf8": Case(("run", "--recipe", "tiny", "logging.root={tmp}/runs", "task.name=gsm8k",
                               "task.path={tmp}/mine.csv"),
                              ("cannot load split 'train' of {tmp}/mine.csv", "UnicodeDecodeError"),
                              {"mine.csv": b"question,answer\ncaf\xe9,1\n"}),
    "bench-traffic-config-without-a-width": Case(  # a KeyError traceback
        ("bench", "traffic", "--recipe", "tiny", "--model-config", "{tmp}/c.json"), ("c.json: no hidden_size",),
        {"c.json": b'{"model_type": "qwen2", "num_hidden_layers": 4}'}),
    "bench-traffic-config-heads-do-not-divide": Case(
        ("bench", "traffic", "--recipe", "tiny", "--model-config", "{tmp}/c.json"), ("no model can be built",),
        {"c.json": b'{"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 3}'}),
    # sizes no run of the model has: were priced without a word
    "bench-traffic-rows-past-the-positions": Case(
        ("bench", "traffic", "--recipe", "bigmath_shallow", "--tokens-per-row", "99999999999999999999"),
        ("--tokens-per-row 99999999999999999999", "positions")),
    "bench-traffic-lora-rank-past-the-width": Case(
        ("bench", "traffic", "--recipe", "bigmath_shallow", "--lora-rank", "100000"), ("--lora-rank 100000", "width 1536")),
    # int() and float() read other scripts' digits: a number typed in them is refused, not taken
    "steps-fullwidth-digit": override("trainer.steps=\uff16", names=("trainer.steps", "digits other than 0-9")),
    "seed-arabic-indic-digit": override("trainer.seed=\u0663", names=("trainer.seed", "digits other than 0-9")),
    "file-lr-fullwidth-digits": recipe(BASE + "grpo: {lr: \"\uff12e-4\"}\n", "key 'grpo.lr'", "digits other than 0-9"),
    # float() skips an underscore between digits: 1e-4_0 was taken as 1e-40
    "lr-underscore-in-exponent": override("grpo.lr=1e-4_0", names=("grpo.lr", "underscore in a number")),
    "file-lr-underscore-in-exponent": recipe(BASE + "grpo: {lr: \"1e-4_0\"}\n", "key 'grpo.lr'",
                                             "underscore in a number"),
    # YAML 1.1 itself reads these as numbers, skipping the underscores (1_000 was 1000, 1__0 was 10)
    "lr-underscore-yaml-number": override("grpo.lr=1_000", names=("grpo.lr=1_000", "its underscores skipped")),
    "temperature-underscore-yaml-float": override("sampler.temperature=1_0.5", names=("1_0.5", "underscores skipped")),
    "file-steps-underscore-yaml-number": recipe(BASE + "trainer: {steps: 1__0}\n", "'1__0'", "underscores skipped"),
    "clip-underscore-in-a-list": override("grpo.clip=[0.2,1e-1_0]", names=("grpo.clip", "underscore in a number")),
    "steps-underscore-in-hex": override("trainer.steps=0x1_0", names=("'0x1_0'", "underscores skipped")),
    "steps-binary": override("trainer.steps=0b1_1", names=("'0b1_1'", "a binary number in YAML 1.1")),
    "lr-underscore-after-a-leading-point": override("grpo.lr=.0_003", names=("'.0_003'", "underscores skipped")),
    "logging-root-a-file": Case(("run", "--recipe", "tiny", "logging.root={tmp}/afile"), ("logging.root", "afile"),
                                {"afile": b"not a folder\n"}),
    # a store's URL was taken as the relative folder ./s3:/b/r
    "logging-root-a-url": override("logging.root=s3://b/r", names=("logging.root=s3://b/r", "a folder on this machine")),
    "file-logging-root-a-chained-url": recipe(BASE.replace("root: runs", "root: 'simplecache::file:///x'"),
                                              "key 'logging.root'", "a folder on this machine"),
    # an output folder given as a URL was made as a local folder named webhdfs: or http:
    "probe-out-a-url": Case(("probe", "coherence", "--recipe", "tiny", "--out", "webhdfs://host/x"),
                            ("probe coherence: --out", "not a URL")),
    "bench-dir-a-url": Case(("bench", "two-node", "--dir", "http://host/x"), ("bench two-node: --dir http://host/x",
                                                                              "not a URL")),
    "export-out-a-url": Case(("export", "{tmp}/no-run", "webhdfs://host/x"), ("export: OUT webhdfs://host/x",
                                                                               "not a URL")),
    "analyze-health-binary": Case(("analyze", "health", "{tmp}/metrics.csv"), ("metrics.csv", "not a CSV text file"),
                                  {"metrics.csv": bytes(range(256)) * 4}),
    "bench-link-bandwidth-zero": Case(("bench", "link", "--bandwidth", "0"), ("--bandwidth",)),
    # --- issue 14, point 8: trained without complaint before
    "clip-low-negative": override("grpo.clip=[-1,0.28]"),
    "kl-coef-negative": override("grpo.kl_coef=-1"),
    "top-p-zero": override("sampler.top_p=0"),
    "label-noise-above-one": override("model.warmup.label_noise=2.0"),
    "eval-size-negative": override("task.eval_size=-1"),
    "val-every-negative": override("trainer.val_every=-1"),
    "checkpoint-every-negative": override("trainer.checkpoint_every=-5"),
    "max-grad-norm-negative": override("grpo.max_grad_norm=-1"),
    "steps-1e20": override("trainer.steps=1e20"),
    "steps-huge": override("trainer.steps=100000000000000000000"),
    "recipe-empty": recipe("", "empty"),
    "recipe-only-comments": recipe("# nothing here\n", "empty"),
    "duplicate-yaml-key": recipe(BASE + "grpo: {lr: 0.1}\ngrpo: {lr: 0.2}\n", "duplicate key 'grpo'", "line 4"),
    "duplicate-nested-key": recipe(BASE + "grpo:\n  lr: 0.1\n  lr: 0.2\n", "duplicate key 'lr'"),
    "max-new-tokens-1e11": override("sampler.max_new_tokens=1e11"),
    "max-new-tokens-huge": override("sampler.max_new_tokens=100000000000"),
    "max-new-tokens-beyond-positions": override("sampler.max_new_tokens=128", names=(
        "command line: override 'sampler.max_new_tokens=128'", "max_positions")),
    "section-not-a-mapping": recipe(BASE.replace("logging: {root: runs}\n", "") + "trainer: 5\n",
                                    "key 'trainer'", "expected a mapping"),
    "section-not-a-mapping-override": override("trainer=5", names=("command line: override 'trainer=5'", "mapping")),
    # --- recipe-file values are credited to the file, not the command line
    "file-lr-negative": recipe(BASE + "grpo: {lr: -1}\n", "key 'grpo.lr'"),
    "file-seed-too-large": recipe(BASE + "trainer: {seed: 99999999999}\n", "key 'trainer.seed'"),
    "file-heads": recipe(BASE + "model: {tiny: {num_heads: 3}}\n", "key 'model.tiny.num_heads'"),
    "file-nan": recipe(BASE + "grpo: {lr: .nan}\n", "key 'grpo.lr'"),
    # --- more of the same kind
    "lr-inf": override("grpo.lr=inf"),
    "beta-one": override("grpo.betas=[0.9,1.0]"),
    "clip-low-above-one": override("grpo.clip=[1.5,0.28]"),
    "pipeline-codec-unknown": override("pipeline.codec=topk"),
    "group-size-one": override("sampler.group_size=1"),
    "steps-fraction": override("trainer.steps=1.5"),
    "steps-zero": override("trainer.steps=0"),
    "kv-heads-do-not-divide": override("model.tiny.num_kv_heads=3"),
    "odd-head-width": override("model.tiny.hidden_size=96", "model.tiny.num_heads=32",
                               names=("command line", "model.tiny.num_heads", "even")),
    "accelerator-unknown": override("trainer.accelerator=tpu"),
    "strategy-unknown": override("trainer.strategy=ddp"),
    "top-p-above-one": override("sampler.top_p=1.5"),
    "task-unknown": override("task.name=nope"),
    "task-digits-zero": override("task.digits=0"),
    "task-digits-too-many": override("task.digits=12", names=("command line: override 'task.digits=12'", "digits")),
    "task-operations": override("task.operations=/", names=("command line: override 'task.operations=/'",)),
    "template-without-question": override("task.prompt_template=hello"),
    "task-path-missing": override("task.name=gsm8k", "task.path={tmp}/nowhere.jsonl"),
    # arithmetic and calculator generate their problems: the file would be ignored and the run train on sums
    "task-path-for-a-generated-task": Case(("run", "--recipe", "tiny", "logging.root={tmp}/runs", "task.path={tmp}/mine.jsonl"),
                                           ("override 'task.path={tmp}/mine.jsonl'", "generates its problems"),
                                           {"mine.jsonl": b'{"question": "1+1?", "answer": "#### 2"}\n'}),
    "task-hf-name-for-a-generated-task": override("task.name=calculator", "task.hf_name=openai/gsm8k"),
    "task-data-not-json": Case(("run", "--recipe", "tiny", "logging.root={tmp}/runs", "task.name=gsm8k",
                                "task.path={tmp}/bad.jsonl"), ("bad.jsonl:1: not valid JSON",),
                               {"bad.jsonl": b'{"question": "1+1?", "answer": "#### 2"\n'}),
    "task-data-no-usable-rows": Case(("run", "--recipe", "tiny", "logging.root={tmp}/runs", "task.name=gsm8k",
                                      "task.path={tmp}/rows.jsonl", "task.eval_size=1"), ("rows.jsonl", "no usable training rows"),
                                     {"rows.jsonl": b'{"text": "no question here"}\n' * 4}),
    # JSON keeps the last of a field given twice, silently
    "task-data-field-twice": Case(("run", "--recipe", "tiny", "logging.root={tmp}/runs", "task.name=gsm8k",
                                   "task.path={tmp}/rows.jsonl"), ("rows.jsonl:2: field 'answer' given twice",),
                                  {"rows.jsonl": b'{"question": "1+1?", "answer": "#### 2"}\n'
                                                 b'{"question": "2+2?", "answer": "#### 4", "answer": "#### 5"}\n'}),
    # pandas took the first and renamed the second (answer.1): every gold was the first column's
    "task-csv-column-twice": Case(("run", "--recipe", "tiny", "logging.root={tmp}/runs", "task.name=gsm8k",
                                   "task.path={tmp}/rows.csv"), ("rows.csv: the column 'answer' appears twice",),
                                  {"rows.csv": b"question,answer,answer\n3+1,#### 99,#### 4\n" * 8}),
    "reward-timeout-zero": override("task.reward_timeout_s=0"),
    "hf-without-name": override("model.source=hf", names=("command line: override 'model.source=hf'", "model.name")),
    "gguf-file-missing": override("model.source=gguf", "model.gguf_file={tmp}/none.gguf"),
    "gguf-file-not-gguf": Case(("run", "--recipe", "tiny", "logging.root={tmp}/runs", "model.source=gguf",
                                "model.gguf_file={tmp}/fake.gguf"), ("model.gguf_file={tmp}/fake.gguf", "not a GGUF file"),
                               {"fake.gguf": b"<html>not a model</html>"}),
    "hf-folder-without-config": Case(("run", "--recipe", "tiny", "logging.root={tmp}/runs", "model.source=hf",
                                      "model.name={tmp}"), ("model.name={tmp}", "no config.json"), {"weights.bin": b"x"}),
    "hf-name-a-file": Case(("run", "--recipe", "tiny", "logging.root={tmp}/runs", "model.source=hf",
                            "model.name={tmp}/model.gguf"), ("model.name=", "is a file, not a model folder"),
                           {"model.gguf": b"GGUF...."}),
    "mask-ratio-inverted": override("grpo.mask_ratio=[2,1]"),
    "pipeline-layout-unknown": override("trainer.strategy=pipeline", "pipeline.layout=bogus"),
    "pipeline-more-stages-than-layers": override("trainer.strategy=pipeline", "pipeline.stages=9",
                                                 names=("command line: override 'pipeline.stages=9'", "layers")),
    "run-name-escapes-root": override("logging.name=../elsewhere"),
    "unknown-key": override("grpo.kl_cof=0.3", names=("command line", "did you mean 'grpo.kl_coef'")),
    "override-without-equals": override("grpo.lr", names=("command line", "key=value")),
    "override-escaped-interpolation": override('logging.name="\\u0024{oc.env:HOME}"',
                                               names=("command line", "interpolation")),
    "override-list-index": override("grpo.betas[0]=0.5", names=("command line", "a list is set whole")),
    "override-nested-too-deep": override("grpo.lr=" + "[" * 300 + "]" * 300, names=("command line",)),
    "recipe-binary": recipe(b"\x00\x01\x02 binary\n", "not valid YAML"),
    "recipe-a-list": recipe("- 1\n- 2\n", "mapping"),
    "recipe-bad-yaml": recipe("description: [unclosed\n", "not valid YAML", "line 2"),
    "recipe-empty-section": recipe(BASE + "trainer:\n", "key 'trainer'", "empty section"),
    "recipe-defaults-explode": Case(("run", "--recipe", "{tmp}/d0.yaml"), ("d0.yaml", "key 'defaults'", "more than 64"),
                                    {f"d{i}.yaml": f"defaults: [{'tiny' if i == 9 else f'd{i + 1}.yaml'}, "
                                                   f"{'tiny' if i == 9 else f'd{i + 1}.yaml'}]\n".encode()
                                     for i in range(10)}),
    "recipe-missing": Case(("run", "--recipe", "{tmp}/missing.yaml"), ("missing.yaml",)),
    "recipe-unknown-name": Case(("run", "--recipe", "tinny"), ("did you mean 'tiny'",)),
    "resume-last-without-runs": Case(("run", "--recipe", "tiny", "--resume", "last", "logging.root={tmp}/runs"),
                                     ("resume",)),
    "callback-module-missing": recipe(NO_PRESETS + "callbacks:\n  - class_path: no_such_pkg_tcl.mod.Cb\n",
                                      "callbacks[0].class_path", "no module"),
    "callback-not-a-callback": recipe(NO_PRESETS + "callbacks:\n  - class_path: collections.OrderedDict\n",
                                      "callbacks[0].class_path", "not a lightning Callback"),
    "callback-not-a-path": recipe(NO_PRESETS + "callbacks:\n  - class_path: 'not a path'\n", "callbacks[0].class_path"),
    "callback-bad-init-args": recipe(
        NO_PRESETS + "callbacks:\n  - class_path: tclightning.callbacks.collapse.CollapseDetector\n"
        "    init_args: {no_such_argument: 1}\n", "callbacks[0].init_args"),
    "analyze-health-inf-step": Case(("analyze", "health", "{tmp}/m.csv"), ("m.csv", "not a number"),
                                    {"m.csv": b"step,reward/mean\ninf,1.0\n"}),
    "analyze-health-missing": Case(("analyze", "health", "{tmp}/none.csv"), ("none.csv",)),
    "bench-link-bandwidth-nan": Case(("bench", "link", "--bandwidth", "nan"), ("--bandwidth",)),
    # a rate whose waits leave the clock's range (and a tc qdisc refuses): bounded, like zero
    "bench-link-bandwidth-1e-300": Case(("bench", "link", "--stages", "64", "--bandwidth", "1e-300"),
                                        ("--bandwidth", "[0.01, 1e+06]")),
    "bench-step-link-bandwidth-1e-300": Case(("bench", "step-link", "--bandwidth", "1e-300"), ("--bandwidth",)),
    "bench-link-one-stage": Case(("bench", "link", "--stages", "1"), ("--stages",)),
    "bench-codec-no-repeats": Case(("bench", "codec", "--repeats", "0"), ("--repeats",)),
    # sizes that would hang a command or exhaust the machine: refused before anything is loaded
    "warmup-batch-size-huge": override("model.warmup.batch_size=1000000000"),
    "bench-codec-tokens-huge": Case(("bench", "codec", "--tokens", "1000000000000"), ("--tokens x --dim",)),
    # few tokens pass the tokens x dim bound, but a basis codec's covariance is dim x dim (32 GiB here)
    "bench-codec-basis-dim-huge": Case(("bench", "codec", "--codec", "lowrank", "--dim", "65536", "--tokens", "16"),
                                       ("--codec lowrank: --dim",)),
    "bench-codec-device-unknown": Case(("bench", "codec", "--device", "tpu"), ("--device 'tpu'",)),
    "bench-codec-repeats-huge": Case(("bench", "codec", "--repeats", "10000000000"), ("bench codec: --repeats",)),
    "probe-cuts-group-size-huge": Case(("probe", "cuts", "--recipe", "tiny", "--group-size", "1000000000"),
                                       ("--group-size",)),
    "bench-codec-threads-huge": Case(("bench", "codec", "--threads", "100000"), ("--threads",)),
    "bench-link-stages-huge": Case(("bench", "link", "--stages", "100000"), ("bench link: --stages",)),
    "bench-link-rows-huge": Case(("bench", "link", "--rows", "1000000000000"), ("bench link: --rows",)),
    "probe-cuts-threads-huge": Case(("probe", "cuts", "--recipe", "tiny", "--threads", "100000"), ("--threads",)),
    "probe-coherence-lags-huge": Case(("probe", "coherence", "--recipe", "tiny", "--lags", "1000000000"), ("--steps",)),
    "probe-inference-max-new-tokens-huge": Case(("probe", "inference", "--recipe", "tiny", "--max-new-tokens",
                                                 "1000000000"), ("--max-new-tokens",)),
    "probe-inference-batch-size-zero": Case(("probe", "inference", "--recipe", "tiny", "--batch-size", "0"),
                                            ("--batch-size",)),
    # text a terminal or a folder name would act on; names no folder can hold
    "recipe-name-escape": recipe(BASE + 'name: "e\\e[31mRED"\n', "key 'name'", "U+001B"),
    "recipe-description-bidi": recipe('defaults: [tiny]\ndescription: "a\\u202eb"\nlogging: {root: runs}\n',
                                      "key 'description'", "U+202E"),
    "logging-name-bell": override("logging.name=\"x\\ay\"", names=("override 'logging.name=", "U+0007")),
    "logging-name-too-long": override("logging.name=" + "n" * 256, names=("256 bytes", "at most 255")),
    # two callbacks of one checkpoint state: Lightning's "more than one stateful callback" traceback before
    "callback-twice-beside-its-preset": recipe(
        BASE + "callbacks:\n  - class_path: tclightning.callbacks.CollapseDetector\n", "callbacks[",
        "a second CollapseDetector with the same checkpoint state", "its own `name`"),
    "callback-preset-twice": recipe(BASE + "callback_presets: [monitoring, monitoring]\n",
                                    "a second LengthFeedbackMonitor with the same checkpoint state as callbacks[0]"),
    # callback arguments out of their range, and rules a recipe cannot build
    "collapse-rules-text": recipe(
        NO_PRESETS + "callbacks:\n  - class_path: tclightning.callbacks.collapse.CollapseDetector\n"
        "    init_args: {rules: x}\n", "callbacks[0].init_args", "expected health Rule objects"),
    "length-growth-warn-nan": recipe(
        NO_PRESETS + "callbacks:\n  - class_path: tclightning.callbacks.length_feedback.LengthFeedbackMonitor\n"
        "    init_args: {growth_warn: .nan}\n", "callbacks[0].init_args", "growth_warn"),
    "length-truncation-collapse-above-1": recipe(
        NO_PRESETS + "callbacks:\n  - class_path: tclightning.callbacks.length_feedback.LengthFeedbackMonitor\n"
        "    init_args: {truncation_collapse: 5}\n", "callbacks[0].init_args", "truncation_collapse"),
    "gap-k3-band-negative": recipe(
        NO_PRESETS + "callbacks:\n  - class_path: tclightning.callbacks.gap_monitor.GapMonitor\n"
        "    init_args: {k3_band: -1}\n", "callbacks[0].init_args", "k3_band"),
    "collapse-max-rollbacks-negative": recipe(
        NO_PRESETS + "callbacks:\n  - class_path: tclightning.callbacks.collapse.CollapseDetector\n"
        "    init_args: {max_rollbacks: -1}\n", "callbacks[0].init_args", "max_rollbacks"),
    "analyze-health-negative-step": Case(("analyze", "health", "{tmp}/m.csv"), ("m.csv:3", "not a whole number in [0,"),
                                         {"m.csv": b"step,reward/mean\n0,1.0\n-5,1.0\n"}),
    "analyze-health-fractional-step": Case(("analyze", "health", "{tmp}/m.csv"), ("m.csv:2", "'1.5'"),
                                           {"m.csv": b"step,reward/mean\n1.5,1.0\n"}),
    "task-sources-nested": override("task.name=bigmath", "task.sources=[[x, 1]]"),
    # --- issue 25, third pass: sizes and names that hung or read other files
    "task-num-train-huge": override("task.num_train=1000000000000"),
    "task-eval-size-huge": override("task.eval_size=100000000"),
    "probe-inference-calibration-negative": Case(
        ("probe", "inference", "--recipe", "tiny", "--calibration", "-5", "--out", "{tmp}/o"), ("--calibration must be",)),
    "probe-cuts-step-negative": Case(("probe", "cuts", "--recipe", "tiny", "--step", "-1", "--out", "{tmp}/o"),
                                     ("--step must be",)),
    "probe-inference-model-not-gguf": Case(
        ("probe", "inference", "--recipe", "tiny", "--model", "{tmp}/x.gguf", "--out", "{tmp}/o"),
        ("x.gguf is not a GGUF file",), {"x.gguf": b"not a gguf"}),
    "probe-cuts-out-under-proc": Case(("probe", "cuts", "--recipe", "tiny", "--out", "/proc/self/x"),
                                      ("--out /proc/self/x: cannot write in /proc/self",)),
    "task-path-glob-character": Case(
        ("run", "--recipe", "tiny", "logging.root={tmp}/runs", "task.name=gsm8k", "task.path={tmp}/a*.csv"),
        ("a*.csv", "glob character"), {"a*.csv": b"question,answer\nq,#### 2\n", "ab.csv": b"question,answer\n"}),
    "task-row-without-line-breaks": Case(
        ("run", "--recipe", "tiny", "logging.root={tmp}/runs", "task.name=gsm8k", "task.path={tmp}/one.jsonl"),
        ("one.jsonl:1", "longer than 16 MiB"), {"one.jsonl": b'{"question": "' + b"x" * (17 * 2**20) + b'"}'}),
    **{f"task-row-{kind}": Case(
        ("run", "--recipe", "tiny", "logging.root={tmp}/runs", "task.name=gsm8k", "task.path={tmp}/rows.jsonl"),
        ("rows.jsonl:2", said), {"rows.jsonl": b'{"question": "q", "answer": "#### 1"}\n' + row + b"\n"})
       for kind, row, said in [("list", b"[1, 2]", "not list"), ("null", b"null", "not null"),
                               ("number", b"NaN", "not float"), ("deep", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
                               ("lone-surrogate", b'{"question": "\\ud800", "answer": "#### 1"}', "lone surrogate"),
                               ("not-utf8", b'{"question": "\xff", "answer": "#### 1"}', "not UTF-8 text (byte 0xff)")]},
    **{f"task-json-{kind}": Case(
        ("run", "--recipe", "tiny", "logging.root={tmp}/runs", "task.name=gsm8k", "task.path={tmp}/rows.json"),
        ("rows.json", said), {"rows.json": content})
       for kind, content, said in [
           # datasets' ujson overflowed the C stack: the process died of SIGSEGV without a word
           ("deep-array", b'[{"question": ' + b"[" * 20_000 + b"]" * 20_000 + b', "answer": "#### 1"}]', "nested too deeply"),
           ("array-of-numbers", b"[1, 2]", "items are not all objects"),
           ("not-utf8", b'[{"question": "\xff", "answer": "#### 1"}]', "not UTF-8 text (byte 0xff at offset 15)"),
           ("deep-line", b'{"question": "q", "answer": "#### 1"}\n' + b"[" * 20_000 + b"]" * 20_000, "rows.json:2")]},
    "defaults-override": override("defaults=[smollm2]"),
    "callback-init-args-override": Case(
        ("run", "--recipe", "{tmp}/mine.yaml",
         "callbacks=[{class_path: tclightning.callbacks.gap_monitor.GapMonitor, init_args: {k3_band: -1}}]"),
        ("command line: override 'callbacks=", "callbacks[0].init_args", "k3_band"), {"mine.yaml": NO_PRESETS.encode()}),
    "task-every-prompt-too-long": Case(
        ("run", "--recipe", "tiny", "logging.root={tmp}/runs", "task.name=gsm8k", "task.path={tmp}/long.jsonl",
         "task.eval_size=1"), ("every training prompt is longer than the model's 128 positions",),
        {"long.jsonl": b"".join(b'{"question": "%s", "answer": "#### 1"}\n' % (b"q" * (200 + i)) for i in range(4))}),
    "analyze-health-huge-step": Case(("analyze", "health", "{tmp}/m.csv"), ("m.csv:2", "not a whole number in [0,"),
                                     {"m.csv": b"step,reward/mean\n100000000000000000000000000,1.0\n"}),
    "analyze-health-proc": Case(("analyze", "health", "/proc"), ("/proc: is a kernel interface",)),
    "bench-traffic-config-layers-huge": Case(
        ("bench", "traffic", "--recipe", "tiny", "--model-config", "{tmp}/c.json"), ("num_hidden_layers 100000000",),
        {"c.json": b'{"model_type": "llama", "num_hidden_layers": 100000000, "hidden_size": 8, "vocab_size": 10}'}),
    "task-row-huge-integer": Case(
        ("run", "--recipe", "tiny", "logging.root={tmp}/runs", "task.name=gsm8k", "task.path={tmp}/t.jsonl"),
        ("t.jsonl:2: not a row", "4300"),
        {"t.jsonl": b'{"question": "q", "answer": "#### 1"}\n{"question": "q", "answer": "#### 5", "x": ' + b"1" * 5000
         + b"}\n"}),
    "bench-traffic-config-huge-integer": Case(
        ("bench", "traffic", "--recipe", "tiny", "--model-config", "{tmp}/c.json"), ("c.json: not a readable config.json",),
        {"c.json": b'{"model_type": "llama", "hidden_size": ' + b"1" * 5000 + b"}"}),
    "logging-root-proc": override("logging.root=/proc", names=("logging.root: cannot write in /proc",)),
    "logging-root-sys": override("logging.root=/sys", names=("logging.root: cannot write in /sys",)),
}


def run_case(case: Case, folder: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    for name, data in case.files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    argv = [arg.replace("{tmp}", str(folder)) for arg in case.argv]
    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().err


def check_refused(code: int, err: str, names: tuple[str, ...], folder: Path, inputs: set[str]) -> None:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    for name in names:
        assert name in lines[0], (name, lines[0])
    assert code == 2, lines[0]
    assert {p.name for p in folder.iterdir()} == inputs, "nothing may be written before the input is refused"


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_exit_2_nothing_written(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    case = CASES[name]
    folder = tmp_path / "case"
    folder.mkdir()
    monkeypatch.chdir(folder)  # a recipe's relative `runs` lands here too
    started = time.perf_counter()
    code, err = run_case(case, folder, capsys)
    names = tuple(n.replace("{tmp}", str(folder)) for n in case.names)
    check_refused(code, err, names, folder, {name.split("/")[0] for name in case.files})
    # refused up front, not after a model or a benchmark started (generous bound for a loaded machine)
    assert time.perf_counter() - started < 30


def test_overrides_are_credited_to_the_command_line_and_file_values_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    # the file's width (96) is fine with 4 heads; 5 heads from the command line are not
    (tmp_path / "mine.yaml").write_text(BASE + "model: {tiny: {hidden_size: 96}}\n")
    code, err = run_case(Case(("run", "--recipe", "mine.yaml", "model.tiny.num_heads=5"), ()), tmp_path, capsys)
    assert code == 2 and "command line: override 'model.tiny.num_heads=5'" in err and "mine.yaml" not in err
    (tmp_path / "mine.yaml").write_text(BASE + "model: {tiny: {num_heads: 5}}\n")
    code, err = run_case(Case(("run", "--recipe", "mine.yaml", "grpo.lr=0.1"), ()), tmp_path, capsys)
    assert code == 2 and "mine.yaml: key 'model.tiny.num_heads'" in err and "command line" not in err


def test_every_schema_key_has_a_range_and_a_help() -> None:
    """Each key's rule and help sit beside its dataclass field; the walk over the dataclasses finds
    the keys OmegaConf finds, in the same order."""
    keys = leaf_keys(OmegaConf.structured(RecipeConfig))
    assert keys == list(RULES), (set(keys) ^ set(RULES))
    assert all(s.help.strip() for s in settings(RecipeConfig)), [s.key for s in settings(RecipeConfig) if not s.help]


def test_shipped_recipes_and_edges_of_the_ranges_are_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    """The rules refuse the nonsensical, not the unusual: boundary values still load."""
    edges = ["grpo.clip=[0,0.28]", "grpo.clip=[1,0]", "grpo.kl_coef=0", "sampler.top_p=1", "model.warmup.label_noise=1",
             "task.eval_size=0", "trainer.val_every=0", "trainer.checkpoint_every=0", "grpo.max_grad_norm=0",
             "trainer.seed=4294967295", "trainer.num_threads=null", "sampler.max_new_tokens=127",
             "grpo.betas=[0,0.999]"]
    code = main(["recipes", "show", "tiny", *edges])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "seed: 4294967295" in out.out


def test_one_bad_file_on_the_search_path_breaks_no_other_lookup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "broken.yaml").write_bytes(b"description: [unclosed\n")
    (tmp_path / "latin1.yaml").write_bytes(b"description: caf\xe9\n")
    monkeypatch.setenv("TCLIGHTNING_RECIPES", str(tmp_path))
    assert find_recipe("tiny").name == "tiny.yaml"
    listed = {info.name: info for info in list_recipes()}
    assert "tiny" in listed and "unreadable" in listed["broken"].description
    assert main(["recipes", "list"]) == 0
    capsys.readouterr()
    code = main(["recipes", "show", "broken"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "broken.yaml" in err[0] and "not valid YAML" in err[0]


def test_a_listing_shows_control_characters_in_a_recipe_as_escapes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "esc.yaml").write_text('name: "e\\e[31mRED\\a"\ndescription: "clear \\e[2J \\u202e"\n')
    monkeypatch.setenv("TCLIGHTNING_RECIPES", str(tmp_path))
    capsys.readouterr()
    assert main(["recipes", "list"]) == 0
    out = capsys.readouterr().out
    assert "e\\x1b[31mRED\\x07" in out and "clear \\x1b[2J \\u202e" in out
    assert all(c.isprintable() for line in out.splitlines() for c in line), "a listing never writes a control character"


@pytest.mark.parametrize("entry", ["/dev/null", "{tmp}/file.txt", "{tmp}/missing"])
def test_a_recipe_search_path_entry_that_is_not_a_folder_is_one_line(
    entry: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file.txt").write_text("x")
    monkeypatch.setenv("TCLIGHTNING_RECIPES", f"{tmp_path}{os.pathsep}{entry.replace('{tmp}', str(tmp_path))}")
    for argv in (["recipes", "list"], ["run", "--recipe", "tiny", f"logging.root={tmp_path}/runs"]):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "TCLIGHTNING_RECIPES" in err[0] and entry.replace("{tmp}", "") in err[0], err
    assert not (tmp_path / "runs").exists()


def _as_an_ordinary_user(path: str | os.PathLike, mode: int, *args: object, **kwargs: object) -> bool:
    """``os.access`` as a user without root's override: write access follows the mode bits."""
    if mode & os.W_OK and not os.stat(path).st_mode & 0o222:
        return False
    return True


def test_read_only_logging_root_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "readonly"
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() == 0:
        # Root may write into a read-only folder, so for root the refusal never applies; check it as
        # an ordinary user sees the folder. (Dropping to another user cannot work everywhere: the
        # checkout and its .venv may sit in a folder only root can enter, e.g. one from mktemp -d.)
        monkeypatch.setattr(os, "access", _as_an_ordinary_user)
    try:
        code, err = run_case(Case(("run", "--recipe", "tiny", f"logging.root={folder}/runs"), ()), tmp_path, capsys)
    finally:
        folder.chmod(0o755)
    assert not list(folder.iterdir())
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "logging.root" in lines[0] and "not writable" in lines[0]


def test_mps_where_there_is_none_is_refused_before_anything_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Lightning's refusal came as a traceback (MisconfigurationException)."""
    import torch

    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)  # as on any machine but a Mac
    code, err = run_case(override("trainer.accelerator=mps"), tmp_path, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "trainer.accelerator=mps needs Apple's Metal" in lines[0], err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("callback", ["lightning.pytorch.callbacks.EarlyStopping",
                                      "lightning.pytorch.callbacks.ModelCheckpoint"], ids=["early-stopping", "checkpoint"])
def test_a_callback_monitoring_a_metric_the_run_never_logs_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], callback: str) -> None:
    """Lightning raises at the callback's first check (a traceback): one line naming the callback and the metric."""
    from tests.conftest import FAST

    case = override(*FAST, "trainer.steps=2", "trainer.val_every=1",
                    f"callbacks=[{{class_path: {callback}, init_args: {{monitor: val/acuracy}}}}]")
    code, err = run_case(case, tmp_path, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err, err
    assert lines[-1].startswith(f"error: callbacks: {callback.rpartition('.')[2]}(monitor='val/acuracy') watches a metric")


def _write_package(root: Path, marker: Path) -> None:
    """A package whose ``__init__`` and classes leave ``marker`` behind when their code runs."""
    package = root / "tcl_sidefx_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(f"open({str(marker)!r}, 'a').write('package imported\\n')\n")
    (package / "plain.py").write_text(
        f"class NotACallback:\n    def __init__(self):\n        open({str(marker)!r}, 'a').write('built\\n')\n"
    )


@pytest.mark.parametrize(
    "class_path, fragment, imported",
    [
        ("tcl_sidefx_pkg.missing.Cb", "no module 'tcl_sidefx_pkg.missing'", False),
        ("tcl_sidefx_pkg.plain.NotACallback", "not a lightning Callback", True),
        ("tcl_sidefx_pkg.plain.Absent", "has no 'Absent'", True),
    ],
    ids=["missing-module", "not-a-callback", "missing-class"],
)
def test_callback_class_path_runs_nothing_it_does_not_need(
    class_path: str, fragment: str, imported: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A missing module is refused without running its parent package's code; a class that is not a
    Lightning Callback is refused without being built (importing the named module does run its code)."""
    marker = tmp_path / "ran.txt"
    _write_package(tmp_path, marker)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("tcl_sidefx_pkg")]:
        monkeypatch.delitem(sys.modules, name)
    (tmp_path / "bad.yaml").write_text(NO_PRESETS + f"callbacks:\n  - class_path: {class_path}\n")
    monkeypatch.chdir(tmp_path)
    code, err = run_case(Case(("run", "--recipe", "bad.yaml"), ()), tmp_path, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and fragment in err, err
    ran = marker.read_text() if marker.exists() else ""
    assert "built" not in ran
    assert ("package imported" in ran) == imported
    assert not (tmp_path / "runs").exists()


def test_user_callback_by_import_path_is_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tclightning.recipes.loader import instantiate_callbacks, load_recipe

    (tmp_path / "tcl_user_cb.py").write_text(
        "import lightning as L\n\nclass Mine(L.Callback):\n    def __init__(self, every: int = 1):\n"
        "        self.every = every\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "ok.yaml").write_text(
        BASE + "callbacks:\n  - class_path: tcl_user_cb.Mine\n    init_args: {every: 3}\n"
    )
    callbacks = instantiate_callbacks(load_recipe(str(tmp_path / "ok.yaml")))
    assert [type(c).__name__ for c in callbacks][-1] == "Mine" and callbacks[-1].every == 3



class _OneSecond:
    """``datetime`` for ``tclightning.run`` whose clock stands still: every plan is made in the same second."""

    @staticmethod
    def now():
        from datetime import datetime

        return datetime(2024, 5, 6, 7, 8, 9)


def test_two_runs_planned_in_the_same_second_get_two_run_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tclightning.run as run_module
    from tclightning.recipes.loader import load_recipe, to_dataclass

    monkeypatch.setattr(run_module, "datetime", _OneSecond)
    recipe = to_dataclass(load_recipe("tiny", [f"logging.root={tmp_path}/runs"]))
    first, second = run_module.plan_run(recipe, None), run_module.plan_run(recipe, None)
    assert first.run_dir == second.run_dir  # planning only names a directory; nothing is written yet
    assert not (tmp_path / "runs").exists()
    claimed = [run_module.mark_run_dir(plan.run_dir, recipe, new=True) for plan in (first, second)]
    root = tmp_path / "runs" / "tiny"
    assert claimed == [root / "20240506-070809", root / "20240506-070809-1"]
    assert all((d / run_module.RUN_MARKER).is_file() for d in claimed)
    # a third plan in that second names the next free suffix, and claims it
    assert run_module.mark_run_dir(run_module.plan_run(recipe, None).run_dir, recipe, new=True) == root / "20240506-070809-2"


def test_a_run_whose_planned_directory_is_taken_meanwhile_uses_the_next_and_removes_only_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another run started in the same second claims the planned name between plan and claim: this run
    writes into the next suffix, and when it fails before saving anything it removes that one only."""
    import tclightning.run as run_module

    planned: list[Path] = []

    def plan_then_taken(recipe, resume):
        plan = real_plan(recipe, resume)
        planned.append(plan.run_dir)
        plan.run_dir.mkdir(parents=True)
        (plan.run_dir / "other-run.txt").write_text("the other run's\n")
        return plan

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("trainer build failed")

    real_plan = run_module.plan_run
    monkeypatch.setattr(run_module, "plan_run", plan_then_taken)
    monkeypatch.setattr(run_module, "build_trainer", fail)
    with pytest.raises(RuntimeError, match="trainer build failed"):
        run_module.run("tiny", [f"logging.root={tmp_path}/runs"], quiet=True)
    out = capsys.readouterr()
    ours = planned[0].parent / f"{planned[0].name}-1"
    assert f"run directory: {ours}\n" in out.out and f"removed {ours}" in out.err
    assert not ours.exists()
    assert [p.name for p in planned[0].iterdir()] == ["other-run.txt"]  # the other run's directory is untouched


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}], ids=["offline", "unreachable"])
def test_an_uncached_hub_model_without_a_hub_is_refused_before_anything_is_written(
    env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("HF_HUB_OFFLINE", "HF_ENDPOINT", "HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY",
                 "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--recipe", "tiny", "model.source=hf", "model.name=nobody/not-cached-anywhere"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.name 'nobody/not-cached-anywhere': not in the Hugging Face cache" in err[0], err
    assert "HF_HUB_OFFLINE is set" in err[0] if "HF_HUB_OFFLINE" in env else "127.0.0.1 does not answer" in err[0]
    assert list(tmp_path.iterdir()) == []


def test_a_callback_of_yours_with_the_state_of_one_the_recipe_lists_is_one_error(tmp_path: Path) -> None:
    """``run(extra_callbacks=[CollapseDetector()])`` beside the recipe's own: refused before anything is
    written (Lightning's "more than one stateful callback" traceback before), naming both."""
    from tclightning.callbacks import CollapseDetector
    from tclightning.errors import TclightningError
    from tclightning.run import run

    with pytest.raises(TclightningError, match=r"extra_callbacks\[1\]: a second CollapseDetector with the same "
                                               r"checkpoint state as the recipe's callbacks\[\d\]"):
        run("tiny", [f"logging.root={tmp_path}/runs"], quiet=True,
            extra_callbacks=[CollapseDetector(name="mine"), CollapseDetector()])
    assert not (tmp_path / "runs").exists()
