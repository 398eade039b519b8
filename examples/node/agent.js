// A hookbus agent in Node.js: emit one event to the dispatcher service and print the
// decision (run `hookbus dispatcher` first).
//
//   NATS_URL=nats://127.0.0.1:4222 node agent.js AGENT EVENT 'DATA_JSON' [--collect]
//   node agent.js payments tool:pre '{"tool_name": "sql", "tool_input": {"query": "DROP TABLE t"}}'
//
// Prints the EmitReply (or, with --collect, the CollectReply) as one JSON line. Exit
// status: 0 for a result, 3 for a deny, 2 for an error reply, 1 for a failure to ask.
"use strict";
const { connect, JSONCodec } = require("nats");
const wire = require("./wire");

const jc = JSONCodec();

async function main() {
  const args = process.argv.slice(2);
  const collect = args.includes("--collect");
  const [agent, event, dataText] = args.filter((a) => a !== "--collect");
  if (!agent || !event) throw new Error("usage: node agent.js AGENT EVENT [DATA_JSON] [--collect]");
  const data = JSON.parse(dataText || "{}");
  const nc = await connect({ servers: process.env.NATS_URL || "nats://127.0.0.1:4222" });
  try {
    const subject = collect ? wire.emitAndCollectSubject(event, agent) : wire.emitSubject(event, agent);
    const body = collect
      ? { data, timeout_s: 2 }
      : { data, session_id: process.env.SESSION_ID || undefined, idempotency_key: process.env.IDEMPOTENCY_KEY || undefined };
    for (let attempt = 1; ; attempt++) {
      const msg = await nc.request(subject, jc.encode(body), { timeout: 30000 });
      const reply = jc.decode(msg.data);
      // busy / unavailable: nothing ran; the same request may go to any replica again
      if (reply.error && reply.error.retryable && attempt < 5) continue;
      console.log(JSON.stringify(reply));
      if (reply.error) return 2;
      return !collect && reply.result.action === "deny" ? 3 : 0;
    }
  } finally {
    await nc.close();
  }
}

main().then(
  (status) => process.exit(status),
  (err) => {
    console.error(`error: ${err.message}`);
    process.exit(1);
  },
);
