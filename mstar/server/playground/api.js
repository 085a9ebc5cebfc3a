// HTTP helpers shared by the tabs: JSON requests with the API key, and readers for the SSE and NDJSON
// streams the server answers with.

const keyInput = () => document.getElementById("api-key");

export function headers(extra = {}) {
  const key = keyInput().value.trim();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// POST a JSON body; throw the server's error message on a non-2xx answer.
export async function post(path, body) {
  const response = await fetch(path, {
    method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body),
  });
  await check(response);
  return response;
}

export async function get(path) {
  const response = await fetch(path, { headers: headers() });
  await check(response);
  return response;
}

async function check(response) {
  if (response.ok) return;
  let message = `${response.status} ${response.statusText}`;
  try { message = (await response.json()).error.message; } catch { /* not a JSON error body */ }
  throw new Error(message);
}

// Yield each line of a streamed response body as it arrives.
async function* lines(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    const parts = buffer.split("\n");
    buffer = parts.pop();
    yield* parts;
  }
  if (buffer) yield buffer;
}

// Yield the JSON payload of each server-sent event (`data: {...}`), up to `[DONE]`.
export async function* sseEvents(response) {
  for await (const line of lines(response)) {
    if (!line.startsWith("data:")) continue;
    const data = line.slice(5).trim();
    if (data === "[DONE]") return;
    const event = JSON.parse(data);
    if (event.error) throw new Error(event.error.message);
    yield event;
  }
}

// Yield each chunk of a /generate NDJSON stream.
export async function* ndjson(response) {
  for await (const line of lines(response)) {
    if (!line.trim()) continue;
    const chunk = JSON.parse(line);
    if (chunk.type === "error") throw new Error(chunk.message);
    yield chunk;
  }
}

export function readDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

export function base64Bytes(b64) {
  return Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
}

export function showError(error) {
  document.getElementById("status").textContent = error ? String(error.message || error) : "";
}

// Run `handler` on each submit of `form` (replacing an earlier one), with its button disabled meanwhile
// and any failure shown in the status line.
export function onSubmit(form, handler) {
  form.onsubmit = async (event) => {
    event.preventDefault();
    const button = form.querySelector("button");
    button.disabled = true;
    showError(null);
    try {
      await handler();
    } catch (error) {
      showError(error);
    } finally {
      button.disabled = false;
    }
  };
}
