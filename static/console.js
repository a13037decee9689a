// The operator console (console.html): the feed of /v1/console (voicebot/console.py) drawn as the
// live sessions and channels, and its controls as POSTs to /v1/console/*. Parameter: token=TOKEN.
// What it holds is exposed as window.voicebotConsole (for the browser test), bounded like the page.
import { VoiceSocket, remember, serverUrl } from "/static/voice-client.js";

const token = new URLSearchParams(location.search).get("token");
const MAX_TURNS = 20;  // turns kept per session
const MAX_ENDED = 20;  // ended sessions still shown
const MAX_LATENCIES = 60;  // the sparkline's replies

const state = window.voicebotConsole = {
  connected: false, status: "", voices: [], responders: [], channels: {},
  sessions: {},  // id -> {id, channel, voice, responder, userSpeaking, botSpeaking, partial, error, ended, turns: [...]}
  latencies: [],  // ms from the end of the user's speech to the reply's first audio, all sessions
  commands: [],  // {path, status} of each control used
};
const cards = new Map();  // session id -> its <article>

function session(id) {
  return state.sessions[id] ??= { id, channel: null, voice: "", responder: "", userSpeaking: false, botSpeaking: false,
                                  partial: "", error: "", ended: false, turns: [] };
}

/** A new turn of `s`: `user` what the user said (null: a line the operator said), `turnEnded` once the user's turn is over. */
function addTurn(s, user, turnEnded) {
  const turn = { user, replyId: null, reply: "", latencyMs: null, interrupted: null, turnEnded };
  s.turns.push(turn);
  if (s.turns.length > MAX_TURNS) s.turns.shift();
  return turn;
}

/** The turn a reply belongs to: the one it was given, else the user's turn awaiting its reply, else a said line. */
function turnOfReply(s, replyId) {
  const found = s.turns.find((t) => t.replyId === replyId);
  if (found) return found;
  const last = s.turns.at(-1);
  const turn = last && last.turnEnded && !last.replyId ? last : addTurn(s, null, true);
  turn.replyId = replyId;
  return turn;
}

function onSessionEvent(id, ev) {
  const s = session(id);
  const openTurn = () => { const last = s.turns.at(-1); return last && !last.turnEnded ? last : null; };
  switch (ev.type) {
    case "session.ready": case "session.updated": s.voice = ev.voice; s.responder = ev.responder; break;
    case "speech.started": s.userSpeaking = true; break;
    case "asr.partial": s.partial = ev.text; break;
    case "asr.final": {
      s.userSpeaking = false; s.partial = "";
      if (!ev.text) break;
      const turn = openTurn() ?? addTurn(s, "", false);
      turn.user = turn.user ? `${turn.user} ${ev.text}` : ev.text;
      break;
    }
    case "turn.end": {
      const turn = openTurn() ?? addTurn(s, "", true);
      turn.user = ev.text; turn.turnEnded = true;
      break;
    }
    case "reply.delta": turnOfReply(s, ev.reply_id).reply += ev.text; break;
    case "reply.done": turnOfReply(s, ev.reply_id).reply = ev.text; break;
    case "audio.start": s.botSpeaking = true; turnOfReply(s, ev.reply_id); break;
    case "audio.end": {
      s.botSpeaking = false;
      const turn = turnOfReply(s, ev.reply_id);
      turn.latencyMs = ev.timings?.first_audio_ms ?? null;
      if (turn.user !== null && turn.latencyMs !== null) {
        state.latencies.push(turn.latencyMs);
        if (state.latencies.length > MAX_LATENCIES) state.latencies.shift();
        drawLatency();
      }
      break;
    }
    case "audio.interrupted": s.botSpeaking = false; turnOfReply(s, ev.reply_id).interrupted = ev.reason; break;
    case "error": s.error = `${ev.code}: ${ev.message}`; break;
  }
  draw(s);
}

function onSessions({ live, channels }) {
  const liveIds = new Set(live);
  for (const id of live) session(id);
  for (const s of Object.values(state.sessions)) {
    if (!liveIds.has(s.id) && !s.ended) { s.ended = true; s.userSpeaking = s.botSpeaking = false; }
  }
  const ended = Object.values(state.sessions).filter((s) => s.ended);
  for (const s of ended.slice(0, Math.max(0, ended.length - MAX_ENDED))) { delete state.sessions[s.id]; cards.get(s.id)?.remove(); cards.delete(s.id); }
  state.channels = channels;
  const speakers = new Map(Object.entries(channels).filter(([, c]) => c.speaker).map(([name, c]) => [c.speaker, name]));
  for (const s of Object.values(state.sessions)) { s.channel = speakers.get(s.id) ?? null; draw(s); }
  drawChannels();
  document.getElementById("session-count").textContent = `(${live.length} live)`;
}

function onFeed(message) {
  if (message.type === "snapshot") {
    Object.assign(state, { voices: message.voices, responders: message.responders, sessions: {}, latencies: [] });
    for (const card of cards.values()) card.remove();
    cards.clear();
    for (const { session: id, event } of message.history) onSessionEvent(id, event);
    onSessions(message);
  } else if (message.type === "event") {
    onSessionEvent(message.session, message.event);
  } else if (message.type === "sessions") {
    onSessions(message);
  }
}

// ---- drawing ------------------------------------------------------------------------------------

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text != null) node.textContent = text;
  return node;
}

function options(select, names, chosen) {
  if (select.dataset.names !== names.join("\n")) {
    select.replaceChildren(...names.map((name) => new Option(name, name)));
    select.dataset.names = names.join("\n");
  }
  if (document.activeElement !== select) select.value = chosen;
}

function draw(s) {
  let card = cards.get(s.id);
  if (!card) {
    card = document.getElementById("session-card").content.firstElementChild.cloneNode(true);
    card.dataset.session = s.id;
    wire(card, s.id);
    cards.set(s.id, card);
    document.getElementById("sessions").prepend(card);
  }
  card.classList.toggle("ended", s.ended);
  card.querySelector(".id").textContent = s.id.slice(0, 8) + (s.ended ? " (ended)" : "");
  card.querySelector(".channel").textContent = s.channel ? `on #${s.channel}` : "no channel";
  const who = card.querySelector(".who");
  who.textContent = s.userSpeaking ? "user speaking" : s.botSpeaking ? "bot speaking" : s.ended ? "" : "quiet";
  who.classList.toggle("user", s.userSpeaking);
  who.classList.toggle("bot", s.botSpeaking && !s.userSpeaking);
  card.querySelector(".voice").textContent = s.voice && `voice ${s.voice}`;
  card.querySelector(".responder").textContent = s.responder && `persona ${s.responder}`;
  card.querySelector(".error").textContent = s.error;
  options(card.querySelector("select[name=voice]"), state.voices, s.voice);
  options(card.querySelector("select[name=responder]"), state.responders, s.responder);
  for (const control of card.querySelectorAll("button, input, select")) control.disabled = s.ended;
  const turns = s.turns.map((t) => {
    const item = el("li");
    item.append(el("span", "user-text", t.user === null ? "(said by the operator)" : t.user), " → ",
                el("span", "reply-text", t.reply || "…"));
    if (t.latencyMs !== null) item.append(" ", el("span", "latency", `${Math.round(t.latencyMs)} ms`));
    if (t.interrupted) item.append(" ", el("span", "cut", `cut (${t.interrupted})`));
    return item;
  });
  if (s.partial) turns.push(el("li", "user-text partial", s.partial));
  card.querySelector(".turns").replaceChildren(...turns);
}

function drawChannels() {
  const rows = Object.entries(state.channels).map(([name, c]) => {
    const row = el("tr");
    row.dataset.channel = name;
    const button = el("button", "", c.muted ? "Unmute" : "Mute");
    button.onclick = () => command(`/v1/console/channels/${encodeURIComponent(name)}/mute`, { muted: !c.muted });
    row.append(el("td", "", `#${name}`), el("td", "", c.speaker ? c.speaker.slice(0, 8) : "–"), el("td", "", String(c.listeners)),
               el("td", "", c.muted ? "muted" : "on air"), el("td"));
    row.lastChild.append(button);
    return row;
  });
  document.querySelector("#channels tbody").replaceChildren(...rows);
}

function percentile(sorted, p) { return sorted[Math.max(0, Math.ceil(p * sorted.length) - 1)]; }  // nearest rank

function drawLatency() {
  const values = state.latencies;
  const top = Math.max(...values, 1);
  const y = (v) => (40 - 38 * v / top).toFixed(1);
  const step = 240 / Math.max(values.length - 1, 1);
  const points = values.length === 1 ? [`0,${y(values[0])}`, `240,${y(values[0])}`]  // one reply: a level line
    : values.map((v, i) => `${(i * step).toFixed(1)},${y(v)}`);
  document.querySelector("#sparkline polyline").setAttribute("points", points.join(" "));
  const sorted = [...values].sort((a, b) => a - b);
  document.getElementById("latency-last").textContent = Math.round(values.at(-1));
  document.getElementById("latency-p50").textContent = Math.round(percentile(sorted, 0.5));
  document.getElementById("latency-p95").textContent = Math.round(percentile(sorted, 0.95));
  document.getElementById("latency-count").textContent = values.length;
}

// ---- controls -----------------------------------------------------------------------------------

async function command(path, body) {
  const headers = { "Content-Type": "application/json", ...(token ? { Authorization: `Bearer ${token}` } : {}) };
  let status;
  try {
    const answer = await fetch(path, { method: "POST", headers, body: JSON.stringify(body) });
    status = answer.status;
    if (!answer.ok) document.getElementById("status").textContent = `${path}: ${status} ${(await answer.text()).slice(0, 200)}`;
  } catch (error) {
    status = `failed: ${error}`;
  }
  remember(state.commands, { path, status });
}

function wire(card, id) {
  const base = `/v1/console/sessions/${id}`;
  const form = card.querySelector("form");
  form.onsubmit = (e) => {
    e.preventDefault();
    const text = form.elements.line.value.trim();
    if (text) command(`${base}/say`, { text, interrupt: form.elements.cut.checked });
    form.elements.line.value = "";
  };
  form.elements.interrupt.onclick = () => command(`${base}/interrupt`, {});
  form.elements.end.onclick = () => command(`${base}/end`, {});
  form.elements.voice.onchange = () => command(`${base}/session.update`, { voice: form.elements.voice.value });
  form.elements.responder.onchange = () => command(`${base}/session.update`, { responder: form.elements.responder.value });
}

const statusBadge = document.getElementById("status");
const feed = new VoiceSocket({
  url: serverUrl("/v1/console"),
  token,
  onEvent: (message) => { if (message.type === "snapshot") feed.connected(); onFeed(message); },
  onStatus: (text, status) => {
    Object.assign(state, { connected: status === "connected", status: text });
    statusBadge.textContent = text;
    statusBadge.className = `badge ${status}`;
  },
});
feed.start();
