// What both pages share: the WebSocket to the server (reconnecting, with the token) and the player
// of 24 kHz reply frames. Plain ES module, no build step. The protocol is in docs/protocol.md.

const OUTPUT_RATE = 24000;
// Reconnect delays in seconds; the last one repeats. Reset once a connection is up again.
const BACKOFF_S = [0.5, 1, 2, 4, 8];

// Items kept in the lists pages expose on `window` for tests and the console: a show runs for days.
const MAX_REMEMBERED = 100;

/** Append to `list`, keeping its last MAX_REMEMBERED items. */
export function remember(list, item) {
  list.push(item);
  if (list.length > MAX_REMEMBERED) list.shift();
}

/** ws:// or wss:// (when the page came over https) URL of `path` on the page's own server. */
export function serverUrl(path, params = {}) {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const query = new URLSearchParams(Object.entries(params).filter(([, v]) => v != null && v !== ""));
  return `${scheme}://${location.host}${path}${query.size ? "?" + query : ""}`;
}

/** A WebSocket that reconnects with backoff and says what it is doing through onStatus(text, state). */
export class VoiceSocket {
  constructor({ url, token, onOpen = () => {}, onEvent = () => {}, onAudio = () => {}, onStatus = () => {} }) {
    Object.assign(this, { url, token, onOpen, onEvent, onAudio, onStatus });
    this.attempt = 0;
    this.stopped = true;
    this.ws = null;
    this.timer = null;
  }

  start() {
    this.stopped = false;
    this.connect();
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    this.ws?.close(1000, "bye");
    this.onStatus("stopped", "stopped");
  }

  get open() { return this.ws?.readyState === WebSocket.OPEN; }

  send(data) {
    if (!this.open) return false;
    this.ws.send(data instanceof ArrayBuffer ? data : JSON.stringify(data));
    return true;
  }

  /** Call once the server accepted the session (e.g. on session.ready): backoff starts over. */
  connected() { this.attempt = 0; }

  connect() {
    this.onStatus(this.attempt ? "reconnecting…" : "connecting…", "connecting");
    // Browsers cannot set headers on a WebSocket: the token travels as a subprotocol.
    const ws = new WebSocket(this.url, this.token ? ["voicebot", `token.${this.token}`] : []);
    ws.binaryType = "arraybuffer";
    let retryAfter = null;
    ws.onopen = () => { this.onStatus("connected", "connected"); this.onOpen(); };
    ws.onmessage = (m) => {
      if (typeof m.data !== "string") { this.onAudio(m.data); return; }
      const event = JSON.parse(m.data);
      if (event.type === "error" && event.retry_after_s) retryAfter = event.retry_after_s;
      this.onEvent(event);
    };
    ws.onclose = (e) => {
      if (this.ws !== ws) return;
      this.ws = null;
      if (this.stopped) return;
      if (e.code === 4401) { this.onStatus("refused: wrong or missing token (add ?token=… to the page URL)", "failed"); return; }
      const delay = retryAfter ?? BACKOFF_S[Math.min(this.attempt, BACKOFF_S.length - 1)];
      this.attempt++;
      this.onStatus(`disconnected (${e.code}${e.reason ? " " + e.reason : ""}); reconnecting in ${delay} s`, "waiting");
      this.timer = setTimeout(() => this.connect(), delay * 1000);
    };
    this.ws = ws;
  }
}

/**
 * Plays 24 kHz s16le frames back to back on an AudioContext clock. The first frame of a reply waits
 * `jitterMs` so that later frames, which the server paces in real time, arrive before they are due;
 * each next frame starts exactly where the previous one ends, so the joins have no gaps.
 */
export class Player {
  constructor({ jitterMs = 120 } = {}) {
    // A 24 kHz context: frames play at their own rate and the browser resamples the mixed output
    // once, instead of each frame separately (which could click at the joins).
    this.ctx = new AudioContext({ sampleRate: OUTPUT_RATE, latencyHint: "interactive" });
    this.jitter = jitterMs / 1000;
    this.nextTime = 0;
    this.sources = new Set();
    this.onFirstFrame = () => {};   // (delay in seconds until it is heard) for each reply
    this.stats = { framesReceived: 0, framesSkipped: 0, framesScheduled: 0, framesPlayed: 0, framesStopped: 0, underruns: 0, interruptions: 0 };
    this.replyStarted = false;
  }

  resume() { return this.ctx.resume(); }

  get playing() { return this.sources.size > 0; }

  /** Seconds from now until everything scheduled has been played. */
  get remaining() { return Math.max(0, this.nextTime - this.ctx.currentTime); }

  push(arrayBuffer) {
    this.stats.framesReceived++;
    // A context the page may not start yet (no click) would queue sources without end: skip.
    if (this.ctx.state !== "running") { this.stats.framesSkipped++; return; }
    const pcm = new Int16Array(arrayBuffer);
    const samples = new Float32Array(pcm.length);
    for (let i = 0; i < pcm.length; i++) samples[i] = pcm[i] / 32768;
    const buffer = this.ctx.createBuffer(1, samples.length, OUTPUT_RATE);
    buffer.copyToChannel(samples, 0);
    const now = this.ctx.currentTime;
    if (this.nextTime < now) {
      if (this.replyStarted) this.stats.underruns++;  // a frame came late inside a reply: a gap
      this.nextTime = now + this.jitter;
    }
    if (!this.replyStarted) { this.replyStarted = true; this.onFirstFrame(this.nextTime - now); }
    const source = this.ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(this.ctx.destination);
    source.start(this.nextTime);
    this.nextTime += buffer.duration;
    this.stats.framesScheduled++;
    this.sources.add(source);
    source.onended = () => {
      if (this.sources.delete(source)) this.stats.framesPlayed++;
    };
  }

  /** The reply's last frame has arrived (audio.end): the next frame starts a new reply. */
  endReply() { this.replyStarted = false; }

  /** Barge-in: silence now and forget everything queued. */
  stop() {
    for (const source of this.sources) {
      this.sources.delete(source);
      source.stop();
      this.stats.framesStopped++;
    }
    this.stats.interruptions++;
    this.nextTime = 0;
    this.replyStarted = false;
  }

  close() { this.ctx.close(); }
}
