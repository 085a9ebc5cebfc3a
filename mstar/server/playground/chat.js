// Chat: the conversation so far goes to /v1/chat/completions with stream: true; tokens are shown as they
// arrive. An attached image or audio file travels as a data URL content part.
import { onSubmit, post, readDataURL, sseEvents } from "./api.js";

export function setupChat(model) {
  const log = document.getElementById("chat-log");
  const input = document.getElementById("chat-input");
  const file = document.getElementById("chat-file");
  const messages = [];
  const accepts = model.input_modalities.filter((m) => m === "image" || m === "audio");
  file.closest("label").hidden = accepts.length === 0;
  file.accept = accepts.map((m) => `${m}/*`).join(",");

  onSubmit(document.getElementById("chat-form"), async () => {
    const content = [{ type: "text", text: input.value }];
    let note = "";
    if (file.files[0]) {
      const attachment = file.files[0];
      const url = await readDataURL(attachment);
      const kind = attachment.type.startsWith("audio/") ? "audio_url" : "image_url";
      content.push({ type: kind, [kind]: { url } });
      note = ` [${attachment.name}]`;
    }
    messages.push({ role: "user", content });
    append(log, "user", input.value + note);
    input.value = "";
    file.value = "";
    const reply = append(log, "assistant", "");
    const response = await post("/v1/chat/completions", { model: model.id, messages, stream: true });
    for await (const event of sseEvents(response)) {
      reply.textContent += event.choices?.[0]?.delta?.content ?? "";
      log.scrollTop = log.scrollHeight;
    }
    messages.push({ role: "assistant", content: reply.textContent });
  });
}

function append(log, role, text) {
  const div = Object.assign(document.createElement("div"), { className: `msg ${role}`, textContent: text });
  log.append(div);
  return div;
}
