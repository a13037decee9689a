// The mic page: microphone -> server, reply audio -> speakers, transcripts and figures on screen.
// URL parameters: aec=0 / ns=0 / agc=0 (start with that processing off), mode=ptt, voice=NAME,
// channel=NAME (overlays on that channel follow this session), token=TOKEN, jitter=MS.
import { Player, VoiceSocket, remember, serverUrl } from "/static/voice-client.js";

const CHUNK_MS = 40;  // audio sent every 40 ms: small enough for quick endpointing, few messages
const MAX_LOG_LINES = 200;  // older transcript lines are removed from the page
const PTT_SILENCE_MS = 5000;  // in push-to-talk the key, not a pause, ends the utterance

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
for (const id of ["aec", "ns", "agc"]) $(id).checked = params.get(id) !== "0";
$("mode").value = params.get("mode") === "ptt" ? "ptt" : "hands-free";

// Everything tests (and curious people, from the console) may read.
const page = {
  sessionId: null, resumeToken: null, sampleRate: null, chunksSent: 0, chunksDropped: 0,
  events: {}, finals: [], replies: [], errors: [], resets: 0, player: null,
  stats() { return { ...(this.player?.stats ?? {}), chunksSent: this.chunksSent, chunksDropped: this.chunksDropped }; },
};
window.voicebot = page;

let socket = null, player = null, mic = null, ready = false, talking = false, handsFreeSilenceMs = null, handsFreeTurn = null;
const replyLines = new Map();  // reply_id -> its line in the log (bounded by MAX_LOG_LINES)

// ---- microphone ------------------------------------------------------------------------------

class Mic {
  constructor(onChunk) { this.onChunk = onChunk; this.ctx = null; this.stream = null; this.source = null; }

  /** The audio graph, without the microphone yet: its rate goes into session.start. */
  async prepare() {
    // The device's own rate: Firefox cannot connect a microphone to a context running at another
    // rate, and the server resamples anyway. The server accepts up to 48 kHz.
    this.ctx = new AudioContext();
    if (this.ctx.sampleRate > 48000) { await this.ctx.close(); this.ctx = new AudioContext({ sampleRate: 48000 }); }
    await this.ctx.resume();
    await this.ctx.audioWorklet.addModule("/static/capture-worklet.js");
    this.node = new AudioWorkletNode(this.ctx, "capture", {
      numberOfOutputs: 0,
      processorOptions: { chunkSamples: Math.round(this.ctx.sampleRate * CHUNK_MS / 1000) },
    });
    this.node.port.onmessage = (m) => this.onChunk(m.data);
  }

  get opened() { return this.stream !== null; }

  async open() {
    this.stream = await navigator.mediaDevices.getUserMedia({ audio: {
      channelCount: 1, echoCancellation: $("aec").checked, noiseSuppression: $("ns").checked, autoGainControl: $("agc").checked,
    } });
    this.source = this.ctx.createMediaStreamSource(this.stream);
    this.source.connect(this.node);
  }

  /** Reopen with the current toggles (Chrome cannot switch echo cancellation on a live track). */
  async reopen() { this.release(); await this.open(); }

  release() {
    this.source?.disconnect();
    this.stream?.getTracks().forEach((t) => t.stop());
    this.source = this.stream = null;
  }

  close() { this.release(); this.ctx?.close(); this.ctx = null; }
}

function sendChunk(buffer) {
  const handsFree = $("mode").value === "hands-free";
  if (ready && (handsFree || talking) && socket.send(buffer)) page.chunksSent++;
  else page.chunksDropped++;
}

// ---- connection --------------------------------------------------------------------------------

async function start() {
  $("start").disabled = true;  // until the audio graph is up: a second click would start twice
  player = page.player = new Player({ jitterMs: Number(params.get("jitter") ?? 120) });
  player.onFirstFrame = (delayS) => { page.lastPlayoutMs = Math.round(delayS * 1000); };
  mic = new Mic(sendChunk);
  // Both contexts start inside the click: autoplay rules let audio run only after a gesture.
  await Promise.all([player.resume(), mic.prepare()]);
  socket = new VoiceSocket({
    url: serverUrl("/v1/voice"),
    token: params.get("token"),
    onOpen: () => socket.send({
      type: "session.start", sample_rate: mic.ctx.sampleRate,
      voice: $("voice").value || undefined, channel: params.get("channel") || undefined,
      resume: page.resumeToken || undefined,
    }),
    onEvent,
    onAudio: (buffer) => player.push(buffer),
    onStatus: (text, state) => { ready = ready && state === "connected"; setStatus(text, state); },
  });
  socket.start();
  $("start").textContent = "Stop";
  $("start").disabled = false;
}

function stop() {
  $("start").textContent = "Start";
  socket?.stop(); mic?.close(); player?.close();
  socket = mic = null; ready = false;
}

function setStatus(text, state) { $("status").textContent = text; $("status").dataset.state = state; }

// ---- events ------------------------------------------------------------------------------------

async function onEvent(ev) {
  page.events[ev.type] = (page.events[ev.type] ?? 0) + 1;
  switch (ev.type) {
    case "session.ready":
      page.sessionId = ev.session_id; page.resumeToken = ev.resume_token; page.sampleRate = ev.input_sample_rate;
      $("session").textContent = `${ev.session_id.slice(0, 8)} · ${ev.input_sample_rate} Hz in · voice ${ev.voice}`;
      socket.connected();
      // An empty update reports the server's endpointing, restored when leaving push-to-talk.
      if (handsFreeSilenceMs === null) socket.send({ type: "session.update" });
      else applyMode();
      if (!mic.opened) {
        try { await mic.open(); } catch (e) { logLine("err", `microphone: ${e.message}`); return; }
      }
      ready = true;
      break;
    case "session.updated":
      if (handsFreeSilenceMs === null) { handsFreeSilenceMs = ev.endpoint_silence_ms; handsFreeTurn = ev.turn; applyMode(); }
      break;
    case "speech.started": $("partial").textContent = "…"; break;
    case "asr.partial": $("partial").textContent = ev.text; break;
    case "asr.final":
      $("partial").textContent = "";
      if (!ev.text) break;
      remember(page.finals, ev.text);
      logLine("user", `you: ${ev.text}`, recognizer(ev));
      $("model").textContent = recognizer(ev);
      break;
    case "turn.end": page.lastTurn = turnEnd(ev); break;
    case "reply.delta": replyLine(ev.reply_id).textContent += ev.text; break;
    case "reply.done": replyLine(ev.reply_id).textContent = ev.text; remember(page.replies, ev.text); break;
    case "audio.end": {
      player.endReply();
      const t = ev.timings ?? {};
      if (t.first_audio_ms != null) {
        $("latency").textContent = `${Math.round(t.first_audio_ms)} ms from the end of your speech to the first reply audio`
          + (page.lastPlayoutMs != null ? ` (+${page.lastPlayoutMs} ms playout buffer here)` : "")
          + (page.lastTurn ? `; ${page.lastTurn}` : "");
      }
      break;
    }
    case "audio.interrupted": {
      player.stop();
      const line = replyLines.get(ev.reply_id);
      if (line) {
        const rest = line.textContent.slice(ev.heard_text.length);
        line.textContent = ev.heard_text;
        line.append(Object.assign(document.createElement("span"), { className: "cut", textContent: rest }));
      }
      break;
    }
    case "state.reset": page.resets++; $("resets").textContent = `${page.resets} (last ${ev.duration_ms} ms, ${ev.reason})`; break;
    case "error":
      remember(page.errors, ev.code);
      logLine("err", `error ${ev.code}: ${ev.message}`);
      break;
  }
}

/** What ended the turn (turn.end): the pause the server waited, and how long the model took to judge it. */
function turnEnd(ev) {
  const t = ev.timings ?? {};
  const judged = ev.probability != null ? ` (complete: ${Math.round(ev.probability * 100)} %)` : "";
  const model = t.decision_ms != null ? `, judged in ${Math.round(t.decision_ms)} ms` : "";
  const by = { smart: "end-of-turn model", silence: "silence", "input.end": "you (input.end)" }[ev.by] ?? ev.by;
  return `turn ended by ${by}${judged} after a ${t.pause_ms} ms pause${model}`;
}

/** Which model the transcript came from; `fallback` is the dialect model's result when it ran. */
function recognizer(ev) {
  if (!ev.fallback) return ev.model;
  if (ev.fallback.model === ev.model) return `${ev.model} (dialect fallback used)`;
  return `${ev.model} (dialect fallback ran and lost: “${ev.fallback.text}”)`;
}

function logLine(cls, text, meta) {
  const p = document.createElement("p");
  p.className = cls; p.textContent = text;
  if (meta) p.append(" ", Object.assign(document.createElement("span"), { className: "meta", textContent: meta }));
  const log = $("log");
  log.append(p);
  while (log.childElementCount > MAX_LOG_LINES) log.firstElementChild.remove();
  log.scrollTop = log.scrollHeight;
  return p;
}

function replyLine(id) {
  if (!replyLines.has(id)) {
    const p = logLine("bot", "bot: ");
    const text = document.createElement("span");
    p.append(text);
    replyLines.set(id, text);
    for (const [old, el] of replyLines) if (!el.isConnected) replyLines.delete(old);
  }
  return replyLines.get(id);
}

// ---- controls ----------------------------------------------------------------------------------

function applyMode() {
  const ptt = $("mode").value === "ptt";
  $("talk").hidden = !ptt;
  if (handsFreeSilenceMs !== null) {
    // Push-to-talk: the silence rule with a long wait, the release ends the turn; hands-free: what the server chose.
    const endpointing = ptt ? { endpoint_silence_ms: PTT_SILENCE_MS } : { endpoint_silence_ms: handsFreeSilenceMs, turn: handsFreeTurn };
    socket?.send({ type: "session.update", endpointing });
  }
}

function talk(down) {
  if (down === talking || $("mode").value !== "ptt") return;
  talking = down;
  $("talk").setAttribute("aria-pressed", String(down));
  if (down && player?.playing) socket?.send({ type: "interrupt" });
  if (!down) socket?.send({ type: "input.end" });
}

$("start").onclick = () => (socket ? stop() : start());
$("mode").onchange = applyMode;
$("talk").onpointerdown = () => talk(true);
$("talk").onpointerup = $("talk").onpointerleave = () => talk(false);
const typing = () => document.activeElement?.id === "say-text";
addEventListener("keydown", (e) => { if (e.code === "Space" && !e.repeat && !typing()) { e.preventDefault(); talk(true); } });
addEventListener("keyup", (e) => { if (e.code === "Space" && !typing()) talk(false); });
for (const id of ["aec", "ns", "agc"]) $(id).onchange = () => mic?.opened && mic.reopen();
$("voice").onchange = () => socket?.send({ type: "session.update", voice: $("voice").value });
$("say-form").onsubmit = (e) => {
  e.preventDefault();
  const text = $("say-text").value.trim();
  if (text && socket?.send({ type: "say", text, interrupt: $("say-interrupt").checked })) $("say-text").value = "";
};

fetch("/v1/voices").then((r) => r.json()).then(({ voices, default: fallback }) => {
  const wanted = params.get("voice") ?? fallback;
  for (const v of voices) $("voice").append(new Option(`${v.name} (${v.description ?? v.language})`, v.name, false, v.name === wanted));
}).catch((e) => logLine("err", `could not list voices: ${e.message}`));
applyMode();
