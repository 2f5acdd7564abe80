"""Slow-link benchmark: pipelined training steps of a wide-boundary model over a shaped link.

S ranks (one stage each, gloo over 127.0.0.1) run ``PipelineEngine`` forward/backward steps of a
model whose boundary is wide and whose layers are thin (d=1536, one thin layer per stage), so the
boundary dominates. The link is the loopback of a fresh network namespace shaped with a token
bucket (``tc qdisc add dev lo root tbf rate <R>mbit``), so every byte between the ranks crosses a
R Mbit/s link; the namespace is deleted afterwards, on errors and on Ctrl-C too. Without root,
``ip netns`` or ``tc`` the benchmark says so and paces sends in software instead (each message
sleeps ``bytes * 8 / R`` before it is sent).

Per layout (``dense``, ``shallow`` = first cut compressed, ``all``) and bandwidth it reports the
median step time, the same step on the unshaped loopback (compute and per-message overheads
alone), the boundary bytes of a step, the time those bytes need at the link rate, and the
dense / compressed step-time ratio, with the machine's load average.

``tclightning bench link`` (options in ``tclightning/cli/bench.py``) runs :func:`run_link_bench`;
``python -m tclightning.bench.link --inside OPTIONS_JSON`` is the child it starts inside the
namespace.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from tclightning.processes import LAUNCHER_PID_ENV, child_environment, follow_launcher

LAYOUTS = ("dense", "shallow", "all")


def build_model(stages: int, dim: int, seed: int = 0) -> Any:
    """A wide, thin Llama: d=``dim`` at every cut, 1 attention head of 16 channels, MLP width 16."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=dim, intermediate_size=16, num_hidden_layers=stages, num_attention_heads=1,
        num_key_value_heads=1, head_dim=16, vocab_size=64, tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def _bench_rank(rank: int, world_size: int, options: dict[str, Any]) -> list[dict[str, Any]]:
    """One rank: for each layout, ``warmup`` + ``steps`` timed pipelined forward/backward steps."""
    import torch
    import torch.distributed as dist

    from tclightning.pipeline.config import PipelineConfig
    from tclightning.pipeline.engine import PipelineEngine, StageInputs, no_loss

    rows, length = options["rows"], options["length"]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (rows, length), generator=gen)
    inputs = StageInputs(
        input_ids=ids, attention_mask=torch.ones(rows, length, dtype=torch.long),
        position_ids=torch.arange(length).expand(rows, length), completion_ids=ids[:, length // 2 :],
        completion_mask=torch.ones(rows, length - length // 2),
    )

    def loss_fn(logp: torch.Tensor, mb_rows: torch.Tensor) -> torch.Tensor:
        return -logp.sum() / inputs.completion_mask.sum()

    results = []
    for layout in options["layouts"]:
        model = build_model(world_size, options["dim"])
        config = PipelineConfig(
            stages=world_size, layout=layout, k=options["k"], microbatches=options["microbatches"],
            schedule=options["schedule"], timeout_s=600,
        )
        engine = PipelineEngine(model, config, link_mbit=options.get("paced_mbit"))
        times = []
        for step in range(options["warmup"] + options["steps"]):
            engine.reset_stats()
            engine.set_step(step)
            dist.barrier()
            started = time.perf_counter()
            engine.run(inputs, loss_fn if engine.is_last else no_loss)
            dist.barrier()
            times.append(time.perf_counter() - started)
            model.zero_grad(set_to_none=True)
        wire = engine.metrics()
        times = sorted(times[options["warmup"] :])
        results.append({
            "layout": layout,
            "step_s": times[len(times) // 2],
            "bytes": wire["wire/bytes_fwd"] + wire["wire/bytes_bwd"],
            "dense_bytes": wire["wire/dense_bytes_fwd"] + wire["wire/dense_bytes_bwd"],
        })
    return results


def measure(options: dict[str, Any]) -> list[dict[str, Any]]:
    """Run the ranks here (inside whatever namespace this process is in); rank 0's results."""
    from tclightning.bench.launch import run_ranks

    outcomes = run_ranks(_bench_rank, options["stages"], options, timeout_s=600, join_timeout_s=3600)
    for outcome in outcomes:
        if outcome.error is not None:
            raise RuntimeError(f"benchmark rank {outcome.rank} failed: {outcome.error}\n{outcome.trace or ''}")
    return outcomes[0].value


def netns_problem() -> str | None:
    """Why a shaped namespace cannot be made here (None if it can)."""
    if os.name != "posix" or os.geteuid() != 0:
        return "not running as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed"
    probe = f"tcl-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip()}"
    try:
        shaped = subprocess.run(
            ["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "100mbit",
             "burst", "32kb", "latency", "100ms"], check=False, capture_output=True, text=True,
        )
        if shaped.returncode != 0:
            return f"'tc qdisc add ... tbf' failed: {shaped.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


def _sh(*argv: str) -> None:
    subprocess.run(list(argv), check=True, capture_output=True, text=True)


def remove_orphaned_namespaces(prefix: str) -> None:
    """Delete the namespaces ``<prefix>...-<pid>`` of benchmarks whose process no longer runs
    (killed with -9, which leaves no time to delete them)."""
    listed = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True).stdout
    for name in (line.split()[0] for line in listed.splitlines() if line.strip()):
        pid = name.rpartition("-")[2]
        if name.startswith(prefix) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def measure_in_namespace(options: dict[str, Any], mbit: float) -> list[dict[str, Any]]:
    """Make namespace ``tcl-link-<pid>``, shape its loopback to ``mbit``, run :func:`measure` inside
    it (a child ``python -m tclightning.bench.link --inside``), always delete it."""
    name = f"tcl-link-{os.getpid()}"
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        remove_orphaned_namespaces("tcl-link-")
        _sh("ip", "netns", "add", name)
        # 1500-byte packets (the loopback's default 64 KiB MTU exceeds a small bucket) and a bucket
        # of about 4 ms of traffic (at least 32 KiB), as a home link's shaper would have
        _sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "mtu", "1500", "up")
        burst = max(32 * 1024, int(mbit * 1e6 / 8 * 0.004))
        _sh("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
            "rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "200ms")
        # its own process group: a signal here stops it and the ranks it started, all of them
        with subprocess.Popen(
            ["ip", "netns", "exec", name, sys.executable, "-m", "tclightning.bench.link", "--inside",
             json.dumps(options)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            env=child_environment(**{LAUNCHER_PID_ENV: str(os.getpid())}),  # it dies with this process, kill -9 too
        ) as child:
            try:
                out, err = child.communicate()
            except BaseException:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                raise
        if child.returncode != 0:
            raise RuntimeError(f"benchmark inside namespace {name} failed:\n{err[-4000:]}")
        return json.loads(out.strip().splitlines()[-1])
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
        signal.signal(signal.SIGTERM, previous)


LINK_MBIT = (0.01, 1e6)
"""The link rates a benchmark shapes, in Mbit/s: 10 kbit/s (a step's messages take hours below it,
and a wait past the clock's range is no measurement) to 1 Tbit/s."""


def link_rate_problem(bandwidths: Sequence[float]) -> str | None:
    """Why ``--bandwidth`` cannot be measured, or None: every rate within :data:`LINK_MBIT`."""
    low, high = LINK_MBIT
    bad = [b for b in bandwidths if not (math.isfinite(b) and low <= b <= high)]
    if bad or not bandwidths:
        return f"--bandwidth: every rate must be a number of Mbit/s in [{low:g}, {high:g}], got {bad or '[]'}"
    return None


def check_options(*, bandwidths: Sequence[float], layouts: Sequence[str], stages: int, link: str, rows: int,
                  length: int, dim: int, k: int, microbatches: int, schedule: str, steps: int, warmup: int) -> None:
    """Refuse, before any process starts, options the benchmark cannot measure (``TclightningError``)."""
    from tclightning.errors import TclightningError

    rate = link_rate_problem(bandwidths)
    problems = [
        (rate is not None, rate or ""),
        (not layouts or any(layout not in LAYOUTS for layout in layouts),
         f"--layouts: expected some of {', '.join(LAYOUTS)}, got {list(layouts)}"),
        (stages < 2, f"--stages: a link needs at least 2 stages, got {stages}"),
        (link not in ("auto", "netns", "paced"), f"--link: expected auto, netns or paced, got {link!r}"),
        (rows < 1, f"--rows: expected >= 1, got {rows}"),
        (length < 2, f"--length: expected >= 2 tokens (half prompt, half completion), got {length}"),
        (dim < 1, f"--dim: expected >= 1, got {dim}"),
        (not 1 <= k <= dim, f"--k: expected 1 <= k <= dim ({dim}), got {k}"),
        (microbatches < 1, f"--microbatches: expected >= 1, got {microbatches}"),
        (schedule not in ("gpipe", "1f1b"), f"--schedule: expected gpipe or 1f1b, got {schedule!r}"),
        (steps < 1, f"--steps: expected >= 1, got {steps}"),
        (warmup < 0, f"--warmup: expected >= 0, got {warmup}"),
    ]
    for failed, message in problems:
        if failed:
            raise TclightningError(f"bench link {message}")


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_link_bench(
    *,
    bandwidths: Sequence[float] = (200.0,),
    layouts: Sequence[str] = LAYOUTS,
    stages: int = 2,
    link: str = "auto",
    rows: int = 8,
    length: int = 128,
    dim: int = 1536,
    k: int = 77,
    microbatches: int = 4,
    schedule: str = "gpipe",
    steps: int = 5,
    warmup: int = 2,
    echo: Any = print,
) -> dict[str, Any]:
    """Measure every (bandwidth, layout); ``link``: ``netns`` (tc-shaped namespace, or fail),
    ``paced`` (software pacing), ``auto`` (netns where possible, else paced, saying why).
    Options are checked first (:func:`check_options`), before any process starts."""
    check_options(bandwidths=bandwidths, layouts=layouts, stages=stages, link=link, rows=rows, length=length, dim=dim,
                  k=k, microbatches=microbatches, schedule=schedule, steps=steps, warmup=warmup)
    options = {"stages": stages, "layouts": list(layouts), "rows": rows, "length": length, "dim": dim, "k": k,
               "microbatches": microbatches, "schedule": schedule, "steps": steps, "warmup": warmup}
    method = link
    if link in ("auto", "netns"):
        problem = netns_problem()
        if problem is not None:
            if link == "netns":
                raise RuntimeError(f"cannot shape a network namespace: {problem} (use --link paced)")
            echo(f"note: tc-shaped network namespace unavailable ({problem}); falling back to a "
                 "software-paced link (each send sleeps bytes*8/rate)")
            method = "paced"
        else:
            method = "netns"
    # The same steps on the unshaped loopback, no pacing: what a step costs without the link
    # (compute, Python and gloo per-message overheads), reported beside every shaped row.
    load = [os.getloadavg()[0]]
    unshaped = {r["layout"]: r["step_s"] for r in measure(options)}
    table = []
    for mbit in bandwidths:
        if method == "netns":
            rows_out = measure_in_namespace(options, mbit)
        else:
            rows_out = measure({**options, "paced_mbit": mbit})
        dense = next((r["step_s"] for r in rows_out if r["layout"] == "dense"), None)
        for row in rows_out:
            row.update({
                "mbit": mbit,
                "unshaped_s": unshaped[row["layout"]],
                "wire_s": row["bytes"] * 8 / (mbit * 1e6),
                "speedup": dense / row["step_s"] if dense else None,
            })
            table.append(row)
    load.append(os.getloadavg()[0])
    return {"link": method, "options": options, "rows": table, "load_average": load}


def format_table(result: dict[str, Any]) -> str:
    """Markdown table of :func:`run_link_bench`'s result."""
    o = result["options"]
    tokens = o["rows"] * o["length"]
    lines = [
        (f"link: {result['link']}; {o['stages']} stages (one process each), d={o['dim']}, k={o['k']}, "
         f"{tokens} tokens/step in {o['microbatches']} micro-batches ({o['schedule']}), median of {o['steps']} steps; "
         f"1-min load average {result['load_average'][0]:.1f} at the start, {result['load_average'][-1]:.1f} at the end"),
        "",
        "| Mbit/s | layout | step (s) | unshaped step (s) | boundary MB/step | bytes at link rate (s) | rest (s) | dense / this |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        speedup = f"{r['speedup']:.1f}x" if r["speedup"] else "-"
        lines.append(
            f"| {r['mbit']:g} | {r['layout']} | {r['step_s']:.3f} | {r['unshaped_s']:.3f} | {r['bytes'] / 1e6:.2f} | "
            f"{r['wire_s']:.3f} | {r['step_s'] - r['wire_s']:.3f} | {speedup} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``--inside OPTIONS_JSON``: the child inside the namespace measures and prints JSON (exit 0).
    Anything else is refused with exit 2: the benchmark's command is ``tclightning bench link``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["--inside"] or len(argv) != 2:
        print("usage: python -m tclightning.bench.link --inside OPTIONS_JSON (the child that "
              "`tclightning bench link` starts in its namespace; run that command instead)", file=sys.stderr)
        return 2
    import importlib

    follow_launcher()
    # by module name (not __main__), so the spawned ranks can import _bench_rank
    module = importlib.import_module("tclightning.bench.link")
    print(json.dumps(module.measure(json.loads(argv[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
