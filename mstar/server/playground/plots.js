// Robot actions and latents from /generate, drawn without a library: actions as one SVG line per action
// dimension over the chunk's steps, latents as a canvas heat map (tokens down, features across).
import { ndjson, onSubmit, post, readDataURL } from "./api.js";
import { tensorValues } from "./media.js";

const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];

// The first chunk of `output` in a non-streamed /generate answer.
async function generate(body, output) {
  const answer = await (await post("/generate", { ...body, outputs: [output], stream: false })).json();
  const chunk = answer.outputs[output]?.[0];
  if (!chunk) throw new Error(`the model returned no ${output}`);
  return chunk;
}

async function mediaOf(input) {
  return input.files[0] ? [{ type: "image", data: await readDataURL(input.files[0]) }] : [];
}

export function setupActions(model) {
  onSubmit(document.getElementById("actions-form"), async () => {
    const state = document.getElementById("actions-state").value.split(",").filter((s) => s.trim()).map(Number);
    const body = { text: document.getElementById("actions-prompt").value,
      media: await mediaOf(document.getElementById("actions-file")), options: state.length ? { state } : {} };
    const chunk = await generate(body, "actions");
    const values = tensorValues(chunk);
    const [steps, dims] = chunk.shape.length > 1 ? chunk.shape.slice(-2) : [chunk.shape[0], 1];
    document.getElementById("actions-out").replaceChildren(linePlot(values.slice(-steps * dims), steps, dims));
  });
}

export function setupLatents(model) {
  onSubmit(document.getElementById("latents-form"), async () => {
    const media = await mediaOf(document.getElementById("latents-file"));
    if (!media.length) throw new Error("choose an image to encode");
    // raw bfloat16 bytes: half the size of float32, and a heat map needs no more precision
    const chunk = await generate({ media, encoding: "binary", tensor_dtype: "bfloat16" }, "latents");
    const [rows, cols] = chunk.shape.length > 1 ? chunk.shape.slice(-2) : [1, chunk.shape[0]];
    document.getElementById("latents-out").replaceChildren(heatMap(tensorValues(chunk).slice(0, rows * cols), rows, cols));
  });
}

// An SVG with one polyline per column of the row-major [steps, dims] `values`.
function linePlot(values, steps, dims, width = 480, height = 240) {
  const lo = Math.min(...values), hi = Math.max(...values);
  const x = (t) => (steps > 1 ? (t / (steps - 1)) : 0.5) * (width - 20) + 10;
  const y = (v) => height - 10 - ((v - lo) / (hi - lo || 1)) * (height - 20);
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("class", "plot");
  for (let d = 0; d < dims; d++) {
    const line = document.createElementNS(SVG, "polyline");
    const points = Array.from({ length: steps }, (_, t) => `${x(t)},${y(values[t * dims + d])}`);
    line.setAttribute("points", points.join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", COLORS[d % COLORS.length]);
    svg.append(line);
  }
  return svg;
}

// A canvas colouring each of the row-major [rows, cols] `values`: blue below zero, red above.
function heatMap(values, rows, cols, cell = 6) {
  const canvas = Object.assign(document.createElement("canvas"), { width: cols * cell, height: rows * cell });
  canvas.className = "plot";
  const context = canvas.getContext("2d");
  const scale = Math.max(...values.map(Math.abs)) || 1;
  values.forEach((v, i) => {
    const s = Math.round(255 * (1 - Math.abs(v) / scale));
    context.fillStyle = v < 0 ? `rgb(${s},${s},255)` : `rgb(255,${s},${s})`;
    context.fillRect((i % cols) * cell, Math.floor(i / cols) * cell, cell, cell);
  });
  return canvas;
}
