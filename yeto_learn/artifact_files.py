"""The files a learner leaves in its output directory (no torch here: the launcher names them)."""

from __future__ import annotations

#: A per-directory run id, so that a restarted learner rejoins the same run.
RUN_ID_FILE = "run_id"
#: The final parameters: a torch state dict.
STATE_FILE = "model.pt"
#: The named layout behind the HELLO fingerprint (``yeto_proto.layout.Layout.to_json``).
LAYOUT_FILE = "layout.json"
#: What the learner finished with: ids, steps, fingerprint and contract.
SUMMARY_FILE = "learner.json"
