// A hookbus hook worker in Node.js: two handlers of "tool:pre" that judge SQL.
//
//   NATS_URL=nats://127.0.0.1:4222 node worker.js
//
//   sql_guard     priority 0, fails closed (deny): denies DROP / TRUNCATE TABLE
//   sql_readonly  priority 1, fails open (ignore): denies writes when data.readonly is true
//
// It declares both in the hookbus_handlers KV bucket (compare-and-set, as hookbus's own
// workers do) with their handler set, serves each handler's subject and the event's
// collect subject in the handler's queue group, and the set's chain subject in the set's
// queue group (both handlers in one request), answers every request with one HookReply
// within the caller's budget, refuses what it must not run (busy, unavailable,
// deadline_exceeded, stale_declaration, bad_request), and runs the NATS services API
// service `hookbus-worker` with the encoded keys it serves (liveness). Start it twice: the
// replicas share the load. SIGTERM / SIGINT drain and exit.
"use strict";
const { connect, JSONCodec } = require("nats");
const wire = require("./wire");

const EVENT = "tool:pre";
const MAX_CONCURRENCY = Number(process.env.MAX_CONCURRENCY || 64);
const LATE_MARGIN_S = 0.05;

// The handlers: (event, data) -> a HookResult (only "action" is required).
function sqlGuard(event, data) {
  const query = String((data.tool_input || {}).query || "");
  if (/\b(drop|truncate)\s+table\b/i.test(query)) {
    return { action: "deny", reason: `destructive SQL refused: ${query.slice(0, 80)}` };
  }
  return { action: "continue" };
}

function sqlReadonly(event, data) {
  const query = String((data.tool_input || {}).query || "");
  if (data.readonly === true && /^\s*(insert|update|delete|alter|create)\b/i.test(query)) {
    return { action: "deny", reason: "read-only session: writes refused" };
  }
  return { action: "continue" };
}

const HANDLERS = [
  { name: "sql_guard", priority: 0, failure_policy: "deny", run: sqlGuard },
  { name: "sql_readonly", priority: 1, failure_policy: "ignore", run: sqlReadonly },
];
const NAMES = HANDLERS.map((h) => h.name).sort();
const SET_ID = wire.handlerSetId(NAMES);

function declaration(h) {
  return {
    event: EVENT,
    name: h.name,
    priority: h.priority,
    tool_filter: ["sql*"],
    timeout_s: 2.0,
    failure_policy: h.failure_policy,
    parallel: false,
    retry_safe: true, // no side effects: a dispatcher may hedge a slow call
    subject: wire.handlerSubject(EVENT, h.name),
    collect_subject: wire.collectSubject(EVENT),
    queue_group: wire.queueGroup(h.name),
    handler_set: NAMES, // every handler this process serves: chain requests come to the set
  };
}
for (const h of HANDLERS) h.decl = declaration(h);
const BY_NAME = new Map(HANDLERS.map((h) => [h.name, h]));

const COMPARED = ["priority", "tool_filter", "failure_policy", "timeout_s", "parallel", "retry_safe"];
const ACTIONS = new Set(["continue", "deny", "modify", "inject_context", "ask_user"]);

const jc = JSONCodec();
const state = { draining: false, inflight: 0 };

async function declare(kv, decl) {
  const key = wire.handlerKey(decl.event, decl.name);
  const value = jc.encode(decl);
  for (let turn = 0; turn < 100; turn++) {
    const entry = await kv.get(key);
    try {
      if (entry === null || entry.operation !== "PUT") {
        await kv.create(key, value);
        return;
      }
      const live = entry.json();
      const differs = COMPARED.filter((f) => JSON.stringify(live[f] ?? null) !== JSON.stringify(decl[f]));
      if (differs.length && process.env.REPLACE !== "1") {
        throw new Error(`handler ${decl.name} is declared with other settings (${differs.join(", ")}); REPLACE=1 takes it over`);
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

const err = (code, message, retryable = false) => ({ error: { code, message, retryable } });

// An EventEnvelope, or null if the bytes are not one.
function readEnvelope(bytes) {
  try {
    const env = jc.decode(bytes);
    if (typeof env.id !== "string" || typeof env.event !== "string") return null;
    if (typeof env.data !== "object" || env.data === null || Array.isArray(env.data)) return null;
    return env;
  } catch {
    return null;
  }
}

// What every request gets refused for before anything runs; null: it may run.
function refusal(envelope) {
  if (envelope === null) return err("bad_request", "not an EventEnvelope");
  if (state.draining) return err("unavailable", "the worker is shutting down", true);
  if (state.inflight >= MAX_CONCURRENCY) return err("busy", `over max_concurrency=${MAX_CONCURRENCY}`, true);
  if (typeof envelope.budget_s === "number" && envelope.budget_s <= 0) {
    return err("deadline_exceeded", "the caller's budget was spent on arrival", true);
  }
  return null;
}

// One handler on (its own copy of) the data: a HookReply body for it.
function runHandler(h, event, data) {
  let result;
  try {
    result = h.run(event, structuredClone(data));
  } catch (e) {
    return { handler: h.name, ...err("handler_error", String(e)) };
  }
  if (result === null || result === undefined) result = { action: "continue" };
  if (typeof result !== "object" || !ACTIONS.has(result.action)) {
    return { handler: h.name, ...err("bad_result", "not a HookResult") };
  }
  return { handler: h.name, result };
}

function serveHandler(nc, h, subject) {
  const sub = nc.subscribe(subject, { queue: h.decl.queue_group });
  (async () => {
    for await (const msg of sub) {
      const received = Date.now();
      const envelope = readEnvelope(msg.data);
      const refused = refusal(envelope);
      if (refused) {
        msg.respond(jc.encode({ handler: h.name, ...refused }));
        continue;
      }
      state.inflight++;
      try {
        const reply = runHandler(h, envelope.event, envelope.data);
        const spent = (Date.now() - received) / 1000;
        if (typeof envelope.budget_s === "number" && spent > envelope.budget_s) continue; // the caller gave up
        msg.respond(jc.encode(reply));
      } finally {
        state.inflight--;
      }
    }
  })();
  return sub;
}

// Whether the dispatcher's fold stops at this step, so no later step may run: a deny, an
// unreadable result (bad_result), a failure under policy deny, a parallel step's modify;
// and a step that ran past its time (handler_timeout: the dispatcher calls the rest).
function endsChain(step, reply) {
  if (reply.result) return reply.result.action === "deny" || (step.parallel && reply.result.action === "modify");
  const code = reply.error && reply.error.code;
  return code === "bad_result" || code === "handler_timeout" || step.failure_policy === "deny";
}

// A chain request: the steps in order, one HookReply with every step's reply.
function runChain(envelope, received) {
  const steps = envelope.chain;
  if (!Array.isArray(steps) || steps.length === 0) return err("bad_request", "no steps");
  const missing = steps.filter((s) => !BY_NAME.has(s.handler)).map((s) => s.handler);
  if (missing.length) return err("bad_request", `not served by this process: ${missing.join(", ")}`);
  // judged by another declaration than ours (a rolling update): run nothing
  const stale = steps.filter((s) => JSON.stringify(s.tool_filter ?? null) !== JSON.stringify(BY_NAME.get(s.handler).decl.tool_filter));
  if (stale.length) {
    return err("stale_declaration", `this process serves other declarations of ${stale.map((s) => s.handler).join(", ")}`);
  }
  const deadline = typeof envelope.budget_s === "number" ? received + envelope.budget_s * 1000 : Infinity;
  let giveUp = null; // when the dispatcher may give up on the first step it has not heard finish
  let data = envelope.data;
  const replies = [];
  for (let i = 0; i < steps.length; ) {
    let j = i + 1;
    if (steps[i].parallel) while (j < steps.length && steps[j].parallel) j++;
    const group = steps.slice(i, j).filter((s) => wire.toolFilterMatches(s.tool_filter ?? null, data));
    i = j;
    if (group.length === 0) continue; // skipped by its tool filter: no reply
    const now = Date.now();
    // no progress reply was sent (the handlers return at once), so the dispatcher dates
    // every step from the request: never start one it may have given up on
    if (giveUp === null) giveUp = received + Math.min(...group.map((s) => s.timeout_s ?? 5)) * 1000;
    if (replies.length && now >= giveUp - LATE_MARGIN_S * 1000) break;
    const outs = group.map((step) => {
      const h = BY_NAME.get(step.handler);
      const timeout = Math.min(step.timeout_s ?? 5, h.decl.timeout_s) * 1000;
      if (Math.min(timeout, deadline - now) <= 0) {
        return { handler: step.handler, ...err("handler_timeout", "not run: the chain's budget ran out") };
      }
      const started = Date.now();
      const out = runHandler(h, envelope.event, data);
      if (Date.now() - started > timeout) return { handler: step.handler, ...err("handler_timeout", "ran past its timeout_s") };
      return out;
    });
    for (const [k, out] of outs.entries()) {
      replies.push(out);
      if (endsChain(group[k], out)) return { chain: replies };
    }
    for (const out of outs) {
      if (out.result && out.result.action === "modify" && out.result.data) data = out.result.data;
    }
  }
  return { chain: replies };
}

function serveChain(nc) {
  const sub = nc.subscribe(wire.chainSubject(EVENT, SET_ID), { queue: SET_ID });
  (async () => {
    for await (const msg of sub) {
      const received = Date.now();
      const envelope = readEnvelope(msg.data);
      const refused = refusal(envelope);
      // a chain reply names the handler set (its id); each step's reply names its handler
      if (refused) {
        msg.respond(jc.encode({ handler: SET_ID, ...refused }));
        continue;
      }
      state.inflight++;
      try {
        msg.respond(jc.encode({ handler: SET_ID, ...runChain(envelope, received) }));
      } catch (e) {
        msg.respond(jc.encode({ handler: SET_ID, ...err("internal", String(e)) }));
      } finally {
        state.inflight--;
      }
    }
  })();
  return sub;
}

async function main() {
  const nc = await connect({ servers: process.env.NATS_URL || "nats://127.0.0.1:4222" });
  for (const h of HANDLERS) serveHandler(nc, h, h.decl.subject);
  for (const h of HANDLERS) serveHandler(nc, h, h.decl.collect_subject);
  serveChain(nc);
  await nc.flush(); // subscribed before declared: a declared handler always has a responder
  const kv = await nc.jetstream().views.kv(wire.HANDLERS_BUCKET, wire.HANDLERS_BUCKET_OPTIONS);
  for (const h of HANDLERS) await declare(kv, h.decl);
  // liveness: `hookbus handlers` counts this process as a replica of each encoded key
  const service = await nc.services.add({
    name: wire.WORKER_SERVICE,
    version: "1.0.0",
    description: "hookbus hook worker (Node.js example)",
    metadata: { handlers: wire.servedHandlers(HANDLERS.map((h) => [EVENT, h.name])) },
  });
  // drain on SIGTERM / SIGINT: refuse new requests (unavailable: the dispatcher resends
  // them to another replica), answer the ones received, exit
  const stop = async () => {
    state.draining = true;
    try {
      await service.stop();
      await nc.drain();
      process.exit(0);
    } catch {
      process.exit(1);
    }
  };
  process.on("SIGTERM", stop);
  process.on("SIGINT", stop);
  console.error(`serving ${NAMES.join(", ")} of ${EVENT} (handler set ${SET_ID})`);
}

main().catch((e) => {
  console.error(`error: ${e.message}`);
  process.exit(1);
});
