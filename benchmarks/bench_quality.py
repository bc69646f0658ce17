"""Quality: does low-communication training with yeto reach the loss of one process?

The same model (the byte-level demo model of ``yeto_learn.demo_model``), the same data (Python's
own standard library sources, held-out blocks for evaluation) and the same token budget, trained

  (a) by one process alone with the data-parallel-equivalent batch (M × the learners' batch), and
  (b) by M yeto learners through ``yeto launch`` (a real yeto-sync and M learner processes on
      127.0.0.1), once each with f32, bf16 and q4 pushes.

The syncer's round count sets how long the learners train (they stop at its final cut), so a
run's token count is measured, not dictated, and varies by a few percent. Every yeto run is
therefore matched with a single-process run on exactly its token count (same seed), and runs are
compared by the ratio of their evaluation loss to that matched baseline. The evaluation loss is
measured on the final state (for yeto: the syncer's authoritative final state, which every learner
holds bit for bit). It prints a table, says whether q4's ratio lands within 2% of f32's, and
replaces its section "## Quality (bench_quality.py)" in benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/bench_quality.py [--learners 4] [--steps 600] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from results_md import RESULTS, replace_section  # noqa: E402
from torch import nn  # noqa: E402

from yeto_learn.demo_model import Corpus, eval_loss, make_model, sample_batch  # noqa: E402

HEADING = "## Quality (bench_quality.py)"
Q4_TOLERANCE = 0.02
LR = 3e-3


@dataclass
class Run:
    name: str
    eval_loss: float
    tokens: int
    steps: int
    wire_bytes: int
    seconds: float
    #: The eval loss of one process trained on exactly this run's tokens (yeto runs).
    matched_loss: float = float("nan")

    @property
    def ratio(self) -> float:
        return self.eval_loss / self.matched_loss


def run_yeto(wire_dtype: str, args: argparse.Namespace, out: Path) -> Run:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    argv = [
        sys.executable, "-m", "yeto_learn.cli", "launch",
        "--learners", str(args.learners),
        "--fragments", str(args.fragments),
        "--wire-dtype", wire_dtype,
        "--steps", str(args.steps),
        "--batch-size", str(args.batch_size),
        "--sync-interval", str(args.sync_interval),
        "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"yeto launch ({wire_dtype}) failed:\n{result.stdout}\n{result.stderr}")
    summary = json.loads((out / "summary.json").read_text())
    if not summary["learners_identical"]:
        raise SystemExit(f"{wire_dtype}: learners disagree on the final state")
    learners = summary["per_learner"]
    return Run(
        name=f"yeto, M={args.learners}, {wire_dtype} pushes",
        eval_loss=float(summary["eval_loss_final"]),
        tokens=int(summary["tokens"]),
        steps=round(statistics.mean(int(r["steps"]) for r in learners)),
        wire_bytes=int(summary["bytes_moved"]),
        seconds=float(summary["seconds"]),
    )


def run_single(tokens: int, batch: int, seed: int) -> Run:
    """One process, batch ``batch``, as many steps as ``tokens`` allows."""
    torch.set_num_threads(1)
    corpus = Corpus.load()
    model = make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(seed)
    steps = max(1, round(tokens / batch))
    started = time.monotonic()
    for _ in range(steps):
        x, y = sample_batch(corpus.train, batch, model.context, generator)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        optimizer.step()
    return Run(
        name=f"one process, batch {batch}",
        eval_loss=eval_loss(model, corpus.eval, model.context),
        tokens=steps * batch,
        steps=steps,
        wire_bytes=0,
        seconds=time.monotonic() - started,
    )


def mean_run(runs: list[Run]) -> Run:
    return Run(
        name=runs[0].name,
        eval_loss=statistics.mean(r.eval_loss for r in runs),
        tokens=round(statistics.mean(r.tokens for r in runs)),
        steps=round(statistics.mean(r.steps for r in runs)),
        wire_bytes=round(statistics.mean(r.wire_bytes for r in runs)),
        seconds=statistics.mean(r.seconds for r in runs),
        matched_loss=statistics.mean(r.matched_loss for r in runs),
    )


def ratio_spread(runs: list[Run]) -> str:
    ratios = [r.ratio for r in runs]
    return f"{min(ratios):.3f}–{max(ratios):.3f}" if len(ratios) > 1 else ""


def human_bytes(count: float) -> str:
    return f"{count / 1e6:,.1f} MB" if count else "0"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--steps", type=int, default=600, help="local steps per learner (approx.)")
    parser.add_argument("--batch-size", type=int, default=32, help="per learner")
    parser.add_argument("--sync-interval", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-write", action="store_true", help="do not touch RESULTS.md")
    args = parser.parse_args()

    yeto: dict[str, list[Run]] = {}
    with tempfile.TemporaryDirectory(prefix="yeto-bench-quality-") as scratch:
        for repeat in range(args.repeats):
            for dtype in ("f32", "bf16", "q4"):  # interleaved: drift hits every variant alike
                run = run_yeto(dtype, args, Path(scratch) / f"{dtype}-{repeat}")
                yeto.setdefault(dtype, []).append(run)
                print(f"  {run.name}: eval loss {run.eval_loss:.4f}, {run.tokens} tokens")
    batch = args.learners * args.batch_size
    for runs in yeto.values():
        for run in runs:  # one process on exactly this run's tokens, the same seed for all
            run.matched_loss = run_single(run.tokens, batch, seed=1000).eval_loss
    budget = round(statistics.mean(r.tokens for runs in yeto.values() for r in runs))
    single = run_single(budget, batch, seed=1000)
    print(f"  {single.name}, {single.tokens} tokens: eval loss {single.eval_loss:.4f}")

    means = {d: mean_run(yeto[d]) for d in ("f32", "bf16", "q4")}
    q4_gap = (means["q4"].ratio - means["f32"].ratio) / means["f32"].ratio
    q4_ok = abs(q4_gap) <= Q4_TOLERANCE

    header = (
        "| run | tokens | steps (per learner) | final eval loss | one process, same tokens "
        "| ratio | ratio spread | bytes on the wire |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [
        header,
        f"| {single.name} (mean budget) | {single.tokens:,} | {single.steps:,} | "
        f"{single.eval_loss:.4f} | {single.eval_loss:.4f} | 1.000 |  | 0 |",
    ]
    for dtype, run in means.items():
        lines.append(
            f"| {run.name} | {run.tokens:,} | {run.steps:,} | {run.eval_loss:.4f} | "
            f"{run.matched_loss:.4f} | {run.ratio:.3f} | {ratio_spread(yeto[dtype])} | "
            f"{human_bytes(run.wire_bytes)} |"
        )
    verdict = (
        f"q4 vs f32 (loss / one process on the same tokens): {means['q4'].ratio:.3f} vs "
        f"{means['f32'].ratio:.3f}, {q4_gap:+.2%} — {'PASS' if q4_ok else 'FAIL'} "
        f"(target: within {Q4_TOLERANCE:.0%}); q4 moved "
        f"{means['f32'].wire_bytes / max(means['q4'].wire_bytes, 1):.1f}x fewer bytes than f32"
    )
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    context = (
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, torch {torch.__version__}; model ByteModel(16, 24, 256) "
        f"({sum(p.numel() for p in make_model(0).parameters()):,} parameters), AdamW lr {LR}; "
        f"yeto: M={args.learners} learners × batch {args.batch_size}, {args.fragments} "
        f"fragments, sync interval {args.sync_interval} steps, quorum M, syncer defaults "
        f"(outer Nesterov lr 0.7, momentum 0.9, heloco); one process: batch {batch} "
        f"(the data-parallel equivalent), one run per yeto run on exactly its token count "
        f"(ratio = yeto loss / that loss). Mean of {args.repeats} runs per row (ratio spread = "
        f"min–max). Bytes = everything the learners sent and received. Load average at the "
        f"end: {load}."
    )
    table = "\n".join(lines)
    print()
    print(table)
    print(verdict)
    if not args.no_write:
        replace_section(HEADING, f"{context}\n\n{table}\n\n{verdict}\n")
        print(f"\nwritten to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
