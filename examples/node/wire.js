// What a hookbus client needs of the wire contract (docs/wire.md; `hookbus asyncapi`):
// the name encoding, the subjects and the handlers bucket.
"use strict";

const PREFIX = "hookbus.v1";
const HANDLERS_BUCKET = "hookbus_handlers";

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

// The handlers bucket as hookbus creates it (history 1, file storage, direct get).
const HANDLERS_BUCKET_OPTIONS = { history: 1, allow_direct: true };

module.exports = {
  HANDLERS_BUCKET,
  HANDLERS_BUCKET_OPTIONS,
  collectSubject,
  emitAndCollectSubject,
  emitSubject,
  encodeToken,
  handlerKey,
  handlerSubject,
  queueGroup,
};
