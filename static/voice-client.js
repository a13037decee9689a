// A minimal /v1/voice client for the browser: mic -> 16 kHz s16le -> server; 24 kHz frames -> speakers.
export class VoiceClient {
  constructor({ onEvent = () => {}, onStatus = () => {}, url } = {}) {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    this.url = url || `${scheme}://${location.host}/v1/voice`;
    this.onEvent = onEvent; this.onStatus = onStatus;
    this.playAt = 0; this.sources = new Set();
    window.voicebotStats = this.stats = { framesReceived: 0, framesPlayed: 0, events: [] };
  }
  async start() {
    this.ctx = new AudioContext({ sampleRate: 16000 });
    this.out = new AudioContext({ sampleRate: 24000 });
    await this.ctx.resume(); await this.out.resume();
    const stream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true } });
    await this.ctx.audioWorklet.addModule("/static/capture-worklet.js");
    this.mic = this.ctx.createMediaStreamSource(stream);
    this.node = new AudioWorkletNode(this.ctx, "capture");
    this.mic.connect(this.node);
    this.ws = new WebSocket(this.url); this.ws.binaryType = "arraybuffer";
    this.ws.onopen = () => { this.ws.send(JSON.stringify({ type: "session.start", sample_rate: 16000 })); this.onStatus("connected"); };
    this.ws.onclose = () => this.onStatus("disconnected");
    this.ws.onmessage = (m) => (typeof m.data === "string" ? this.event(JSON.parse(m.data)) : this.play(m.data));
    this.node.port.onmessage = (m) => { if (this.ws.readyState === 1) this.ws.send(m.data); };
  }
  event(ev) {
    this.stats.events.push(ev.type);
    if (ev.type === "audio.interrupted") this.flush();
    this.onEvent(ev);
  }
  play(buf) {
    this.stats.framesReceived++;
    const pcm = new Int16Array(buf), f = new Float32Array(pcm.length);
    for (let i = 0; i < pcm.length; i++) f[i] = pcm[i] / 32768;
    const ab = this.out.createBuffer(1, f.length, 24000); ab.copyToChannel(f, 0);
    const src = this.out.createBufferSource(); src.buffer = ab; src.connect(this.out.destination);
    // A 60 ms jitter buffer when playback (re)starts; after that frames are queued back to back.
    this.playAt = Math.max(this.playAt, this.out.currentTime + 0.06);
    src.start(this.playAt); this.playAt += ab.duration;
    this.sources.add(src); src.onended = () => { this.sources.delete(src); this.stats.framesPlayed++; };
  }
  flush() { for (const s of this.sources) { try { s.stop(); } catch {} } this.sources.clear(); this.playAt = 0; }
  stop() { this.flush(); this.ws?.close(); this.mic?.disconnect(); this.ctx?.close(); this.out?.close(); }
}
