// A hookbus hook worker in Node.js: one handler of "tool:pre" that denies destructive SQL.
//
//   NATS_URL=nats://127.0.0.1:4222 node worker.js
//
// It declares the handler in the hookbus_handlers KV bucket (compare-and-set, as hookbus's
// own workers do), serves its subject and the event's collect subject in the handler's
// queue group (start it twice: the replicas share the load), and answers every request
// with one HookReply within the caller's budget. SIGTERM / SIGINT drain and exit.
"use strict";
const { connect, JSONCodec } = require("nats");
const wire = require("./wire");

const EVENT = "tool:pre";
const DECLARATION = {
  event: EVENT,
  name: process.env.HANDLER_NAME || "sql_guard",
  priority: Number(process.env.HANDLER_PRIORITY || 0),
  tool_filter: ["sql*"],
  timeout_s: 2.0,
  failure_policy: "deny",
  parallel: false,
  retry_safe: true, // no side effects: a dispatcher may hedge a slow call
};
DECLARATION.subject = wire.handlerSubject(EVENT, DECLARATION.name);
DECLARATION.collect_subject = wire.collectSubject(EVENT);
DECLARATION.queue_group = wire.queueGroup(DECLARATION.name);

const COMPARED = ["priority", "tool_filter", "failure_policy", "timeout_s", "parallel", "retry_safe"];

// The handler itself: (event, data) -> a HookResult (only "action" is required).
function sqlGuard(event, data) {
  const query = String((data.tool_input || {}).query || "");
  if (/\b(drop|truncate)\s+table\b/i.test(query)) {
    return { action: "deny", reason: `destructive SQL refused: ${query.slice(0, 80)}` };
  }
  return { action: "continue" };
}

const jc = JSONCodec();

async function declare(nc) {
  const kv = await nc.jetstream().views.kv(wire.HANDLERS_BUCKET, wire.HANDLERS_BUCKET_OPTIONS);
  const key = wire.handlerKey(DECLARATION.event, DECLARATION.name);
  const value = jc.encode(DECLARATION);
  for (let turn = 0; turn < 100; turn++) {
    const entry = await kv.get(key);
    try {
      if (entry === null || entry.operation !== "PUT") {
        await kv.create(key, value);
        return;
      }
      const live = entry.json();
      const differs = COMPARED.filter((f) => JSON.stringify(live[f] ?? null) !== JSON.stringify(DECLARATION[f]));
      if (differs.length && process.env.REPLACE !== "1") {
        throw new Error(`handler ${DECLARATION.name} is declared with other settings (${differs.join(", ")}); REPLACE=1 takes it over`);
      }
      await kv.update(key, value, entry.revision);
      return;
    } catch (err) {
      if (!/wrong last sequence/i.test(String(err && err.message))) throw err;
      // another writer won the race: read again
    }
  }
  throw new Error("too many racing writers");
}

function reply(handler, body) {
  return jc.encode({ handler, ...body });
}

function serve(nc, subject) {
  const sub = nc.subscribe(subject, { queue: DECLARATION.queue_group });
  (async () => {
    for await (const msg of sub) {
      const received = Date.now();
      let envelope;
      try {
        envelope = jc.decode(msg.data);
        if (typeof envelope.event !== "string" || typeof envelope.data !== "object" || envelope.data === null) {
          throw new Error("not an EventEnvelope");
        }
      } catch (err) {
        msg.respond(reply(DECLARATION.name, { error: { code: "bad_request", message: String(err.message) } }));
        continue;
      }
      const budget = envelope.budget_s;
      if (typeof budget === "number" && budget <= 0) {
        msg.respond(reply(DECLARATION.name, {
          error: { code: "deadline_exceeded", message: "the caller's budget was spent on arrival", retryable: true },
        }));
        continue;
      }
      try {
        const result = sqlGuard(envelope.event, envelope.data);
        const spent = (Date.now() - received) / 1000;
        if (typeof budget === "number" && spent > budget) continue; // the caller gave up
        msg.respond(reply(DECLARATION.name, { result }));
      } catch (err) {
        msg.respond(reply(DECLARATION.name, { error: { code: "handler_error", message: String(err) } }));
      }
    }
  })();
  return sub;
}

async function main() {
  const nc = await connect({ servers: process.env.NATS_URL || "nats://127.0.0.1:4222" });
  serve(nc, DECLARATION.subject);
  serve(nc, DECLARATION.collect_subject);
  await nc.flush(); // subscribed before declared: a declared handler always has a responder
  await declare(nc);
  // drain on SIGTERM / SIGINT: stop taking requests, answer the ones received, exit
  const stop = () => nc.drain().then(() => process.exit(0), () => process.exit(1));
  process.on("SIGTERM", stop);
  process.on("SIGINT", stop);
  console.error(`serving ${DECLARATION.name} on ${DECLARATION.subject} (queue ${DECLARATION.queue_group})`);
}

main().catch((err) => {
  console.error(`error: ${err.message}`);
  process.exit(1);
});
