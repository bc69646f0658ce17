"""Two yeto learners training one small regression model against a running yeto-sync.

Start a syncer first, for example::

    .venv/bin/yeto-sync --learners 2 --total-steps 40 --sync-interval-steps 4

then run this script with the address it printed::

    .venv/bin/python examples/train_two_learners.py 127.0.0.1:29400

Each learner is an ordinary torch training loop with three added lines: build the
``Learner``, call ``learner.step()`` after every optimizer step, and ``learner.finish()`` at the
end. Learners here are threads for brevity; normally each is its own process or machine.
"""

from __future__ import annotations

import sys
import threading

import torch

import yeto_learn

RUN_ID = "example-two-learners"


def train(syncer: str, learner_id: int, losses: dict[int, float]) -> None:
    torch.manual_seed(learner_id)
    target = torch.linspace(-1.0, 1.0, 16).reshape(4, 4)  # the shared task
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    learner = yeto_learn.Learner(
        model,
        syncer=syncer,
        learner_id=learner_id,
        num_learners=2,
        fragments=2,
        streams=1,
        run_id=RUN_ID,  # every learner of one run shares it; a fresh run takes a fresh one
    )
    loss = torch.tensor(0.0)
    while not learner.final_ready:
        inputs = torch.randn(32, 4)
        loss = torch.nn.functional.mse_loss(model(inputs), inputs @ target.T)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        learner.step(tokens=len(inputs))
    learner.finish()
    losses[learner_id] = loss.item()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    losses: dict[int, float] = {}
    threads = [threading.Thread(target=train, args=(argv[0], i, losses)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for learner_id, loss in sorted(losses.items()):
        print(f"learner {learner_id}: final local loss {loss:.4f}")
    return 0 if len(losses) == 2 else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
