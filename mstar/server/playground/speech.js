// Speech: /v1/audio/speech as server-sent events of 16-bit PCM. Each piece is played through Web Audio as
// it arrives; at the end the whole clip becomes a WAV file in the <audio> player, to replay or save.
import { base64Bytes, onSubmit, post, sseEvents } from "./api.js";

export function setupSpeech(model) {
  const voice = document.getElementById("speech-voice");
  const player = document.getElementById("speech-audio");
  const voices = model.voices.length ? model.voices : [""];
  voice.replaceChildren(...voices.map((v) => new Option(v || "default", v)));

  onSubmit(document.getElementById("speech-form"), async () => {
    const body = { model: model.id, input: document.getElementById("speech-input").value,
      response_format: "pcm", stream_format: "sse" };
    if (voice.value) body.voice = voice.value;
    const response = await post("/v1/audio/speech", body);
    const pieces = [];
    let rate = 24000;
    const live = new LivePlayer();
    for await (const event of sseEvents(response)) {
      if (event.type !== "speech.audio.delta") continue;
      rate = event.sample_rate || rate;
      const pcm = new Int16Array(base64Bytes(event.audio).buffer);
      pieces.push(pcm);
      live.play(pcm, rate);
    }
    player.src = URL.createObjectURL(wavBlob(pieces, rate));
  });
}

// Schedules PCM pieces back to back on one AudioContext, so speech is heard while it is still being made.
class LivePlayer {
  constructor() {
    this.context = new AudioContext();
    this.next = 0;
  }

  play(pcm, rate) {
    if (pcm.length === 0) return;
    const buffer = this.context.createBuffer(1, pcm.length, rate);
    buffer.getChannelData(0).set(Float32Array.from(pcm, (s) => s / 32768));
    const source = this.context.createBufferSource();
    source.buffer = buffer;
    source.connect(this.context.destination);
    this.next = Math.max(this.next, this.context.currentTime);
    source.start(this.next);
    this.next += buffer.duration;
  }
}

// A mono 16-bit WAV file of the PCM pieces.
function wavBlob(pieces, rate) {
  const samples = pieces.reduce((n, p) => n + p.length, 0);
  const header = new DataView(new ArrayBuffer(44));
  const text = (offset, s) => [...s].forEach((c, i) => header.setUint8(offset + i, c.charCodeAt(0)));
  text(0, "RIFF");
  header.setUint32(4, 36 + 2 * samples, true);
  text(8, "WAVEfmt ");
  header.setUint32(16, 16, true);
  header.setUint16(20, 1, true); // PCM
  header.setUint16(22, 1, true); // mono
  header.setUint32(24, rate, true);
  header.setUint32(28, 2 * rate, true);
  header.setUint16(32, 2, true);
  header.setUint16(34, 16, true);
  text(36, "data");
  header.setUint32(40, 2 * samples, true);
  return new Blob([header, ...pieces], { type: "audio/wav" });
}
