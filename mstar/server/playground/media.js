// Image and video generation. Images come from the native /generate stream, which also carries
// `progress` values when the model reports them; videos are /v1/videos jobs, polled for their progress,
// then fetched and played.
import { base64Bytes, get, ndjson, onSubmit, post } from "./api.js";

export function setupImage(model) {
  const bar = document.getElementById("image-progress");
  const out = document.getElementById("image-out");
  onSubmit(document.getElementById("image-form"), async () => {
    const outputs = model.reports_progress ? ["image", "progress"] : ["image"];
    bar.hidden = !model.reports_progress;
    bar.value = 0;
    const text = document.getElementById("image-prompt").value;
    const response = await post("/generate", { text, outputs, stream: true });
    for await (const chunk of ndjson(response)) {
      if (chunk.output === "progress") bar.value = tensorValues(chunk).at(-1);
      if (chunk.type === "image") {
        const img = Object.assign(new Image(), { src: `data:image/png;base64,${chunk.data}`, alt: text });
        out.replaceChildren(img);
      }
    }
  });
}

export function setupVideo(model) {
  const bar = document.getElementById("video-progress");
  const out = document.getElementById("video-out");
  onSubmit(document.getElementById("video-form"), async () => {
    bar.hidden = false;
    bar.value = 0;
    const prompt = document.getElementById("video-prompt").value;
    let job = await (await post("/v1/videos", { model: model.id, prompt })).json();
    while (job.status === "queued" || job.status === "in_progress") {
      await new Promise((resolve) => setTimeout(resolve, 250));
      job = await (await get(`/v1/videos/${job.id}`)).json();
      bar.value = job.progress;
    }
    if (job.status !== "completed") throw new Error(job.error?.message || `video job ${job.status}`);
    const mp4 = await (await get(`/v1/videos/${job.id}/content`)).blob();
    const video = Object.assign(document.createElement("video"), {
      src: URL.createObjectURL(mp4), controls: true, autoplay: true, loop: true, muted: true,
    });
    out.replaceChildren(video);
  });
}

// The numbers of a /generate action or tensor chunk: its JSON `values`, or its little-endian `data` bytes
// (bfloat16 widened to float32 by putting its two bytes on top of two zero bytes).
export function tensorValues(chunk) {
  if (chunk.values) return chunk.values.map(Number);
  const bytes = base64Bytes(chunk.data).buffer;
  if (chunk.dtype === "bfloat16") {
    const halves = new Uint16Array(bytes), words = new Uint32Array(halves.length);
    halves.forEach((h, i) => { words[i] = h << 16; });
    return Array.from(new Float32Array(words.buffer));
  }
  const types = { float32: Float32Array, float64: Float64Array, int64: BigInt64Array, int32: Int32Array };
  const Type = types[chunk.dtype];
  if (!Type) throw new Error(`cannot show a ${chunk.dtype} tensor`);
  return Array.from(new Type(bytes), Number);
}
