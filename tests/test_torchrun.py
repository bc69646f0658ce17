"""A torchrun learner (2 gloo ranks on CPU) and a single-process learner share one session.

Learner 0 runs as ``python -m torch.distributed.run --nproc-per-node 2 -m yeto_learn.demo_model``
on 127.0.0.1: only its rank 0 talks to the syncer; applied fragments reach rank 1 by
``torch.distributed`` broadcasts, and the ranks' tokens are summed. Learner 1 is one plain
process. At the end all three replicas must hold the syncer's final checkpoint bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from syncer_process import REPO, child_env, free_port, running_syncer

from yeto_proto import Layout
from yeto_proto.checkpoint import read_checkpoint

BATCH = 16


def checkpoint_digest(checkpoint_path: Path, layout: Layout) -> str:
    """The demo model's parameter digest (name order, f32 bytes), computed from a checkpoint."""
    checkpoint = read_checkpoint(checkpoint_path)
    tensors: dict[str, bytes] = {}
    for fragment, state in zip(layout.fragments, checkpoint.fragments, strict=True):
        at = 0
        for tensor in fragment.tensors:
            tensors[tensor.name] = state.params[at : at + tensor.numel].tobytes()
            at += tensor.numel
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name])
    return digest.hexdigest()


def records(stdout: str) -> list[dict[str, Any]]:
    out = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_two_gloo_ranks_and_a_single_learner_finish_with_identical_replicas(
    tmp_path: Path,
) -> None:
    extra = ["--sync-interval-steps", "8", "--quorum", "2"]
    with running_syncer(tmp_path / "syncer", learners=2, total_steps=12, extra=extra) as syncer:
        common = [
            "--syncer", syncer.address,
            "--num-learners", "2",
            "--fragments", "3",
            "--wire-dtype", "bf16",
            "--run-id", "torchrun-test",
            "--batch-size", str(BATCH),
            # Past the cap from the 6th step: the ranks agree on every step whether the
            # rounds stalled (one rank's own clock stopping it would hang DDP's collectives).
            "--max-steps", "5",
            "--progress-every", "1000",
            "--connect-timeout", "90",
        ]  # fmt: skip
        torchrun = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(free_port()),
                "-m",
                "yeto_learn.demo_model",
                "--learner-id",
                "0",
                "--out",
                str(tmp_path / "learner-0"),
                *common,
            ],  # fmt: skip
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        single = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "yeto_learn.demo_model",
                "--learner-id",
                "1",
                "--out",
                str(tmp_path / "learner-1"),
                *common,
            ],  # fmt: skip
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        ranks_out, ranks_err = torchrun.communicate(timeout=150)
        single_out, single_err = single.communicate(timeout=60)
        assert torchrun.returncode == 0, ranks_err[-3000:]
        assert single.returncode == 0, single_err[-3000:]
        assert syncer.wait() == 0, syncer.log_tail()

    done = [r for r in records(ranks_out) + records(single_out) if r["event"] == "done"]
    by_place = {(r["learner"], r["rank"]): r for r in done}
    assert set(by_place) == {(0, 0), (0, 1), (1, 0)}

    # Every replica holds the final checkpoint, bit for bit.
    layout = Layout.from_json((tmp_path / "learner-0" / "layout.json").read_text())
    expected = checkpoint_digest(syncer.checkpoint, layout)
    assert {r["params_sha256"] for r in done} == {expected}
    assert all(r["final_global_step"] == 12 for r in done)  # rank 1 too: it holds the cut

    # The torchrun learner steps once per collective step with both ranks' tokens.
    ranks = by_place[(0, 0)]
    assert ranks["steps"] == by_place[(0, 1)]["steps"]
    assert ranks["tokens"] == 2 * BATCH * ranks["steps"]
    assert by_place[(1, 0)]["tokens"] == BATCH * by_place[(1, 0)]["steps"]
    merges = [json.loads(line) for line in syncer.tape.read_text().splitlines()]
    torchrun_responses = [r for m in merges for r in m.get("responders", []) if r["id"] == 0]
    assert torchrun_responses
    assert all(r["c_tokens"] == 2 * BATCH * r["c_steps"] for r in torchrun_responses)

    # Only rank 0 writes the learner's artifact; the loss fell for everyone.
    assert (tmp_path / "learner-0" / "model.pt").is_file()
    for record in done:
        assert record["eval_loss_final"] < record["eval_loss_start"] - 1.0, record
