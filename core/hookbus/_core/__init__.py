"""hookbus._core: the machinery that workers and the dispatcher share (private).

Not the wire contract (that is `hookbus.schemas`, which this package builds on and which
never imports it): handler options and the fold's stop rule, validation of registry
records, a handler's JSON copy of the data, reply inboxes, JetStream bucket configs and
config comparisons, opening a bucket and retrying idempotent JetStream calls through a
leader election, KV reads and key subscriptions (`kv`), answer proofs read and applied in
stream order (`proofs`, the approvals' and the ``ai`` integration's tool approvals'),
JetStream consumers held in an identity's slots (`consumers`), stopping a background task
(`tasks`), the loop clock and the one value for time, `Deadline` (`clock`,
`deadlines`), the nats-py client's guards, consumer-slot naming, rate-limited logging,
OpenTelemetry provider caching and the embedded nats-server (`embedded_server`: the CLI's
default server and the test kit's real one); and what the packages above share: opening
the decisions stream (`decisions_stream`), reading suspension records back
(`suspension_records`), approvers' names (`approvers`) and unpadded base64url
(`base64url`: NATS JWTs, the console's cookie). It sits on `hookbus.schemas`
(the only package of ours it imports, through its public modules) and below
`hookbus.workers` and `hookbus.dispatcher` (which never import each other); the packages
above them may use it too. No public API: every name here may change in any release.
"""
