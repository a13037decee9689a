// Runs on the audio thread: downmixes the microphone to mono, converts to s16le and posts chunks of
// `chunkSamples` (at the AudioContext's own rate: the page declares that rate in session.start and
// the server resamples). The buffer holds exactly one chunk; a full one is transferred, not copied.
class Capture extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.size = options.processorOptions.chunkSamples;
    this.chunk = new Int16Array(this.size);
    this.filled = 0;
  }

  process(inputs) {
    const channels = inputs[0];
    if (!channels.length) return true;
    const frames = channels[0].length;
    for (let i = 0; i < frames; i++) {
      let sum = 0;
      for (const channel of channels) sum += channel[i];
      const s = (sum / channels.length) * 32767;
      this.chunk[this.filled++] = s > 32767 ? 32767 : s < -32768 ? -32768 : Math.round(s);
      if (this.filled === this.size) {
        this.port.postMessage(this.chunk.buffer, [this.chunk.buffer]);  // detaches this.chunk
        this.chunk = new Int16Array(this.size);
        this.filled = 0;
      }
    }
    return true;
  }
}

registerProcessor("capture", Capture);
