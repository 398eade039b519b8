"""The parts of `hookbus.integrations.ai` (private), one job each:

- `labels`: how a hook is named and marked (its label, a tool approval, the ``"_ai"``
  metadata key) and what the parts read of the `HookbusHooks` they serve (`HooksSettings`);
- `run_claims`: one live run per run id (`RunInProgressError`);
- `proofs`: a tool approval decided only by an approver's answer proof;
- `tool_approvals`: a tool approval used once per tool call and run, its timeout's
  outcome kept, a re-asked turn decided by the earlier approval;
- `waits`: each ``ai.hook`` call answered from the suspensions bucket;
- `tool_calls`: every tool call emitted through the dispatcher (``tool:pre`` /
  ``tool:post`` / ``tool:error``);
- `turns`: the assistant turn each run's model is giving, for the messages to resume from;
- `events`: hookbus's hook events as ``ai``'s.
"""
