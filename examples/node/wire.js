// What a hookbus client needs of the wire contract (docs/wire.md; `hookbus asyncapi`):
// the name encoding, the subjects, the handler set id and the handlers bucket.
"use strict";
const crypto = require("crypto");

const PREFIX = "hookbus.v1";
const HANDLERS_BUCKET = "hookbus_handlers";
const WORKER_SERVICE = "hookbus-worker"; // the NATS services API name liveness pings

// One subject token / KV key segment per name: [A-Za-z0-9_-] as is, every other byte of
// the UTF-8 text as =XX (upper-case hex). "tool:pre" -> "tool=3Apre".
function encodeToken(name) {
  if (!name) throw new Error("a name may not be empty");
  let out = "";
  for (const byte of Buffer.from(name, "utf8")) {
    const ch = String.fromCharCode(byte);
    out += /[A-Za-z0-9_-]/.test(ch) ? ch : "=" + byte.toString(16).toUpperCase().padStart(2, "0");
  }
  return out;
}

// The agent token: "=" for a call without an agent id.
const agentToken = (agentId) => (agentId ? encodeToken(agentId) : "=");

const handlerKey = (event, handler) => `${encodeToken(event)}.${encodeToken(handler)}`;
const handlerSubject = (event, handler) => `${PREFIX}.handler.${handlerKey(event, handler)}`;
const collectSubject = (event) => `${PREFIX}.collect.${encodeToken(event)}`;
const queueGroup = (handler) => encodeToken(handler);
const emitSubject = (event, agentId) => `${PREFIX}.emit.${agentToken(agentId)}.${encodeToken(event)}`;
const emitAndCollectSubject = (event, agentId) =>
  `${PREFIX}.emit_and_collect.${agentToken(agentId)}.${encodeToken(event)}`;

// The id of the set of handler names one worker process serves (HandlerDeclaration.handler_set):
// 32 lower-case hex digits of SHA-256 over the encoded names, sorted, unique, one per line.
// It is also the queue group of the set's chain subject.
function handlerSetId(names) {
  const tokens = [...new Set(names.map(encodeToken))].sort(); // byte order: tokens are ASCII
  return crypto.createHash("sha256").update(tokens.join("\n"), "utf8").digest("hex").slice(0, 32);
}
const chainSubject = (event, setId) => `${PREFIX}.chain.${encodeToken(event)}.${setId}`;

// The worker service's `handlers` metadata: the served handlers' keys, encoded, one space
// apart. A key that is not encoded ("tool:pre.guard") is ignored by every reader.
const servedHandlers = (pairs) => pairs.map(([event, handler]) => handlerKey(event, handler)).join(" ");

// A tool filter (fnmatch globs: * ? [seq] [!seq]) matched against data.tool_name, ignoring
// case; null matches everything, and only a string tool_name can match a filter.
function toolFilterMatches(filter, data) {
  if (filter === null || filter === undefined) return true;
  const name = data && data.tool_name;
  if (typeof name !== "string") return false;
  return filter.some((glob) => globRegExp(glob).test(name.toLowerCase()));
}

function globRegExp(glob) {
  let rx = "";
  const g = glob.toLowerCase();
  for (let i = 0; i < g.length; i++) {
    const c = g[i];
    if (c === "*") rx += "[\\s\\S]*";
    else if (c === "?") rx += "[\\s\\S]";
    else if (c === "[" && g.indexOf("]", i + 2) > 0) {
      const end = g.indexOf("]", i + 2);
      let body = g.slice(i + 1, end);
      if (body.startsWith("!")) body = "^" + body.slice(1);
      rx += "[" + body.replace(/\\/g, "\\\\") + "]";
      i = end;
    } else rx += c.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
  }
  return new RegExp(`^(?:${rx})$`);
}

// The handlers bucket as hookbus creates it (history 1, file storage, direct get).
const HANDLERS_BUCKET_OPTIONS = { history: 1, allow_direct: true };

module.exports = {
  HANDLERS_BUCKET,
  HANDLERS_BUCKET_OPTIONS,
  WORKER_SERVICE,
  chainSubject,
  collectSubject,
  emitAndCollectSubject,
  emitSubject,
  encodeToken,
  handlerKey,
  handlerSetId,
  handlerSubject,
  queueGroup,
  servedHandlers,
  toolFilterMatches,
};
