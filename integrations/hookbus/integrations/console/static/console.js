// hookbus console: plain JavaScript, no build step. Every value from the bus is put on the
// page as text (textContent), never as HTML.
"use strict";

const POST_HEADERS = { "Content-Type": "application/json", "X-Hookbus-Console": "1" };
const state = { approvals: new Map(), grants: new Map(), decisions: [], offsetMs: 0, seq: 0,
                touched: { approvals: new Map(), grants: new Map() } };
let stream = null;

function $(id) { return document.getElementById(id); }

// A list is loaded while the feed goes on: an event that arrives during the load is newer
// than, or as new as, the list for its key, so the list is taken for every key but those.
function touch(kind, key) {
  state.seq += 1;
  state.touched[kind].set(key, state.seq);
  if (state.touched[kind].size > 5000) state.touched[kind].clear();
}

async function loadList(kind, path, itemsOf, keyFn) {
  const start = state.seq;
  const doc = await api(path);
  const fresh = new Map(itemsOf(doc).map((item) => [keyFn(item), item]));
  for (const [key, seq] of state.touched[kind]) {
    if (seq <= start) continue;
    if (state[kind].has(key)) fresh.set(key, state[kind].get(key)); else fresh.delete(key);
  }
  state[kind] = fresh;
  return doc;
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

class ApiError extends Error {
  constructor(status, code, message) { super(message); this.status = status; this.code = code; }
}

async function api(path, body) {
  const init = body === undefined
    ? { credentials: "same-origin" }
    : { method: "POST", headers: POST_HEADERS, body: JSON.stringify(body),
        credentials: "same-origin" };
  const response = await fetch(path, init);
  let doc = null;
  try { doc = await response.json(); } catch (e) { doc = null; }
  if (response.status === 401 && path !== "/api/login") { showLogin(); }
  if (!response.ok) {
    const err = (doc && doc.error) || {};
    throw new ApiError(response.status, err.code || "error",
                       err.message || `HTTP ${response.status}`);
  }
  return doc;
}

// -- signing in ---------------------------------------------------------------------------
function showLogin(message) {
  if (stream) { stream.close(); stream = null; }
  setLive(false);
  $("console").hidden = true;
  $("who").hidden = true;
  $("logout").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("token").focus();
}

function showConsole(approver) {
  $("login").hidden = true;
  $("console").hidden = false;
  $("who").hidden = false;
  $("who").textContent = `signed in as ${approver}`;
  $("logout").hidden = false;
  openStream();
}

async function start() {
  const session = await api("/api/session");
  $("approver-field").hidden = session.approver_bound;
  $("approver").required = !session.approver_bound;
  if (session.nats_approver && !$("approver").value) $("approver").value = session.nats_approver;
  if (session.signed_in) showConsole(session.approver); else showLogin();
}

$("login-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  $("login-error").textContent = "";
  try {
    const me = await api("/api/login", { token: $("token").value, approver: $("approver").value });
    $("token").value = "";
    showConsole(me.approver);
  } catch (e) {
    $("login-error").textContent = e.message;
  }
});

$("logout").addEventListener("click", async () => {
  try { await api("/api/logout", {}); } finally { showLogin("Signed out."); }
});

// -- the live feed --------------------------------------------------------------------------
function setLive(on) {
  $("live").className = on ? "live on" : "live off";
  $("live").textContent = on ? "live" : "offline";
}

function openStream() {
  if (stream) stream.close();
  stream = new EventSource("/events");
  stream.addEventListener("hello", (ev) => {
    setLive(true);
    const hello = JSON.parse(ev.data);
    state.offsetMs = hello.now * 1000 - Date.now();
    loadAll();
  });
  stream.addEventListener("approval", (ev) => onApproval(JSON.parse(ev.data)));
  stream.addEventListener("approval_removed", (ev) => {
    const d = JSON.parse(ev.data);
    for (const [k, a] of state.approvals) {
      if (a.label === d.label) { touch("approvals", k); state.approvals.delete(k); }
    }
    renderApprovals();
  });
  stream.addEventListener("grant", (ev) => {
    const g = JSON.parse(ev.data);
    touch("grants", g.key);
    state.grants.set(g.key, g);
    renderGrants();
  });
  stream.addEventListener("grant_removed", (ev) => {
    const key = JSON.parse(ev.data).key;
    touch("grants", key);
    state.grants.delete(key);
    renderGrants();
  });
  stream.addEventListener("decision", (ev) => {
    addDecisions([JSON.parse(ev.data)]);
    if (state.decisionsOff) {  // a decision came: the trail is on now (its stream was made)
      state.decisionsOff = false;
      $("decisions-note").textContent = "";
    }
    renderDecisions();
  });
  stream.addEventListener("resync", () => loadAll());
  stream.addEventListener("signed_out", () => showLogin("Your sign-in expired."));
  stream.onerror = async () => {
    setLive(false);
    if (stream && stream.readyState === EventSource.CLOSED) {
      stream = null;
      try {
        const session = await api("/api/session");
        if (session.signed_in) setTimeout(openStream, 2000); else showLogin();
      } catch (e) { setTimeout(openStream, 2000); }
    }
  };
}

async function loadAll() {
  await Promise.allSettled([loadApprovals(), loadGrants(), loadDecisions(), loadHandlers()]);
}

// -- approvals --------------------------------------------------------------------------------
const keyOf = (a) => `${a.agent_id === null ? "" : a.agent_id}\u0000${a.label}`;

async function loadApprovals() {
  try {
    const doc = await loadList("approvals", "/api/approvals", (d) => d.approvals, keyOf);
    state.offsetMs = doc.now * 1000 - Date.now();
    $("approvals-note").textContent =
      doc.skipped ? `${doc.skipped} unreadable record(s) skipped` : "";
  } catch (e) {
    $("approvals-note").textContent = `cannot list approvals: ${e.message}`;
  }
  renderApprovals();
}

function onApproval(a) {
  const key = keyOf(a);
  touch("approvals", key);
  if (a.status === "pending") state.approvals.set(key, a);
  else state.approvals.delete(key);
  renderApprovals();
}

function isAllow(choice) { return choice.trim().toLowerCase().startsWith("allow"); }

function timeLeft(a) {
  if (a.expires_at === null) return null;
  return Math.max(0, a.expires_at - (Date.now() + state.offsetMs) / 1000);
}

function formatLeft(s) {
  if (s === null) return "no time limit";
  if (s >= 3600) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min left`;
  if (s >= 60) return `${Math.floor(s / 60)} min ${Math.floor(s % 60)} s left`;
  return `${Math.floor(s)} s left`;
}

function dataText(a) {
  if (a.data !== null && a.data !== undefined) return JSON.stringify(a.data, null, 2);
  if (a.data_preview) return `${a.data_preview}\n… (${a.data_bytes} bytes in all)`;
  return "(not recorded)";
}

function approvalCard(a) {
  const outcome = el("p", { class: "outcome", role: "status" });
  const buttons = a.options.map((choice) => el("button", {
    type: "button", class: isAllow(choice) ? "allow" : "deny", "data-choice": choice,
    onclick: () => answer(a, choice, card, outcome),
  }, choice));
  const left = el("span", { class: "left", "data-expires": a.expires_at }, formatLeft(timeLeft(a)));
  const fact = (name, value) =>
    value === null || value === undefined || value === "" ? null : el("span", {}, `${name} `, el("b", {}, value));
  const card = el("article", { class: "approval", "data-label": a.label },
    el("h3", {}, a.prompt),
    el("div", { class: "facts" },
      fact("agent", a.agent_id), fact("session", a.session_id), fact("tool", a.tool_name),
      fact("handler", a.handler), fact("event", a.event),
      fact("default on timeout", a.default), left),
    el("details", {}, el("summary", {}, "data the handlers saw"), el("pre", {}, dataText(a))),
    el("div", { class: "choices" }, ...buttons),
    el("div", { class: "actions" },
      el("button", { type: "button", class: "cancel", title: "end it unanswered: the call is denied",
                     onclick: () => cancelApproval(a, card, outcome) }, "Cancel")),
    outcome);
  return card;
}

// Ends the approval without an answer: the waiting call (or its retry) is denied.
async function cancelApproval(a, card, outcome) {
  for (const b of card.querySelectorAll("button")) b.disabled = true;
  outcome.textContent = "cancelling…";
  try {
    await api("/api/approvals/cancel", { label: a.label, agent_id: a.agent_id });
    state.approvals.delete(keyOf(a));
    touch("approvals", keyOf(a));
    renderApprovals();
  } catch (e) {
    outcome.textContent = `cannot cancel: ${e.message}`;
    outcome.classList.add("error");
    if (e.status !== 409 && e.status !== 404) {
      for (const b of card.querySelectorAll("button")) b.disabled = false;
    }
  }
}

async function answer(a, choice, card, outcome) {
  for (const b of card.querySelectorAll("button")) b.disabled = true;
  outcome.textContent = `answering ${choice}…`;
  try {
    const got = await api("/api/approvals/answer",
                          { label: a.label, agent_id: a.agent_id, choice });
    outcome.textContent = `answered ${got.choice} as ${got.answered_by}`;
  } catch (e) {
    outcome.textContent = e.message;
    outcome.classList.add("error");
    if (e.status !== 409 && e.status !== 404) {
      for (const b of card.querySelectorAll("button")) b.disabled = false;
    }
  }
}

function renderApprovals() {
  const list = [...state.approvals.values()].sort((x, y) => x.created_at - y.created_at);
  const box = $("approvals");
  const kept = new Map([...box.children].map((c) => [c.dataset.key, c]));
  const cards = list.map((a) => {
    const key = keyOf(a);
    const card = kept.get(key) || approvalCard(a);
    card.dataset.key = key;
    return card;
  });
  box.replaceChildren(...cards);
  $("pending-count").textContent = list.length;
  $("no-approvals").hidden = list.length > 0;
}

// An approval past its time is ended by the server when the list is read (its default
// applied, nobody waiting): the page shows "expired" and asks for the list again every few
// seconds while one is shown, so it leaves the pending list.
let lastOverdueLoad = 0;
setInterval(() => {
  let overdue = false;
  for (const span of document.querySelectorAll(".left[data-expires]")) {
    const s = Math.max(0, Number(span.dataset.expires) - (Date.now() + state.offsetMs) / 1000);
    span.textContent = s > 0 ? formatLeft(s) : "expired: its default applies";
    span.classList.toggle("urgent", s < 30);
    if (s <= 0) overdue = true;
  }
  if (overdue && Date.now() - lastOverdueLoad > 3000) {
    lastOverdueLoad = Date.now();
    loadApprovals();
  }
}, 1000);

// Each cell carries its column's name (data-label): under 640 px rows are shown as cards
// whose lines read "label value".
function labelCells(table) {
  const names = [...table.tHead.rows[0].cells].map((th) => th.textContent.trim());
  for (const tr of table.tBodies[0].rows) {
    [...tr.cells].forEach((td, i) => { if (names[i]) td.dataset.label = names[i]; });
  }
}

// -- grants -------------------------------------------------------------------------------------
function when(seconds) {
  return seconds ? new Date(seconds * 1000).toISOString().replace("T", " ").slice(0, 19) : "";
}

async function loadGrants() {
  try {
    await loadList("grants", "/api/grants", (d) => d.grants, (g) => g.key);
  } catch (e) { /* shown as empty; the feed reloads on resync */ }
  renderGrants();
}

function renderGrants() {
  const rows = [...state.grants.values()].sort((x, y) => x.granted_at - y.granted_at).map((g) => {
    const button = el("button", { type: "button", class: "revoke", "data-key": g.key,
      onclick: async () => {
        button.disabled = true;
        $("grants-error").textContent = "";
        try {
          await api("/api/grants/revoke", { key: g.key });
          state.grants.delete(g.key);
          renderGrants();
        } catch (e) {
          // said on the page, not in a tooltip: an approver's credentials may not revoke
          button.disabled = false;
          $("grants-error").textContent = `cannot revoke the grant of session ${g.session_id}`
            + ` (${g.tool || "any tool"}): ${e.message}`;
        }
      } }, "Revoke");
    return el("tr", { "data-key": g.key },
      el("td", {}, g.agent_id || ""), el("td", {}, g.session_id), el("td", {}, g.event),
      el("td", {}, g.handler), el("td", {}, g.tool || ""),
      el("td", { class: "time" }, when(g.granted_at)),
      el("td", {}, g.label), el("td", {}, button));
  });
  $("grants").tBodies[0].replaceChildren(...rows);
  labelCells($("grants"));
  $("grants-count").textContent = rows.length;
}

// -- decisions ------------------------------------------------------------------------------------
async function loadDecisions() {
  try {
    const doc = await api("/api/decisions?limit=50");
    addDecisions(doc.records);
    state.decisionsOff = !doc.available && doc.code === "audit_off";
    $("decisions-note").textContent = doc.available ? "" : doc.reason;
  } catch (e) {
    $("decisions-note").textContent = `cannot read the audit trail: ${e.message}`;
  }
  renderDecisions();
}

function addDecisions(records) {
  const byId = new Map(state.decisions.map((d) => [d.id, d]));
  for (const d of records) byId.set(d.id, d);
  state.decisions = [...byId.values()].sort((x, y) => x.time - y.time).slice(-100);
}

function renderDecisions() {
  const rows = state.decisions.slice().reverse().map((d) => el("tr", { "data-emit": d.emit_id },
    el("td", { class: "time" }, when(d.time)), el("td", {}, d.agent_id || ""),
    el("td", {}, d.session_id || ""),
    el("td", {}, d.event), el("td", {}, d.tool_name || ""),
    el("td", { class: `action-${d.action}` }, d.action), el("td", {}, d.decided_by || ""),
    el("td", { class: "approver" }, d.approver || ""),
    el("td", { class: "reason free-text" }, d.reason || "")));
  $("decisions").tBodies[0].replaceChildren(...rows);
  labelCells($("decisions"));
}

// -- handlers ---------------------------------------------------------------------------------------
async function loadHandlers() {
  try {
    const doc = await api("/api/handlers");
    const rows = doc.handlers.map((h) => el("tr", {},
      el("td", {}, h.event), el("td", {}, h.priority), el("td", {}, h.name),
      el("td", {}, (h.tool_filter || ["*"]).join(", ")), el("td", {}, h.failure_policy || ""),
      el("td", {}, h.timeout_s === null ? "" : h.timeout_s),
      el("td", {}, h.required ? (h.declared ? "yes" : "yes, NOT DECLARED") : ""),
      el("td", { class: "replicas" }, h.replicas.length),
      el("td", {}, h.last_seen ? `${Math.max(0, Math.round(Date.now() / 1000 + state.offsetMs / 1000 - h.last_seen))} s ago` : "-")));
    $("handlers").tBodies[0].replaceChildren(...rows);
    labelCells($("handlers"));
    const notes = Object.entries(doc.rejected).map(([k, why]) => `skipped ${k}: ${why}`);
    for (const h of doc.live_only) notes.push(`served but not declared: ${h.name} (${h.event})`);
    $("handlers-note").textContent = notes.join("; ");
  } catch (e) {
    $("handlers-note").textContent = `cannot read the handler registry: ${e.message}`;
  }
}

$("handlers-refresh").addEventListener("click", loadHandlers);

start().catch((e) => showLogin(`cannot reach the console: ${e.message}`));
