// The playground's entry: read the served model's card from /v1/models, show the tabs it can use, and
// wire each tab's form to its module.
import { get, showError } from "./api.js";
import { setupChat } from "./chat.js";
import { setupSpeech } from "./speech.js";
import { setupImage, setupVideo } from "./media.js";
import { setupActions, setupLatents } from "./plots.js";

// Each tab: its label, whether the model card allows it, and the function that wires its form.
const TABS = [
  ["chat", "Chat", (m) => m.output_modalities.includes("text") && m.input_modalities.includes("text"), setupChat],
  ["speech", "Speech", (m) => m.output_modalities.includes("audio") && m.input_modalities.includes("text"), setupSpeech],
  ["image", "Image", (m) => m.output_modalities.includes("image") && m.input_modalities.includes("text"), setupImage],
  ["video", "Video", (m) => m.output_modalities.includes("video") && m.input_modalities.includes("text"), setupVideo],
  ["actions", "Actions", (m) => m.output_modalities.includes("actions"), setupActions],
  ["latents", "Latents", (m) => m.output_modalities.includes("latents"), setupLatents],
];

function select(name) {
  for (const button of document.querySelectorAll("#tabs button")) {
    button.setAttribute("aria-selected", String(button.dataset.tab === name));
  }
  for (const section of document.querySelectorAll("section[data-tab]")) section.hidden = section.dataset.tab !== name;
}

async function start() {
  const keyInput = document.getElementById("api-key");
  keyInput.value = sessionStorage.getItem("mstar-api-key") || "";
  keyInput.addEventListener("change", () => { sessionStorage.setItem("mstar-api-key", keyInput.value); start(); });
  let model;
  try {
    model = (await (await get("/v1/models")).json()).data[0];
  } catch (error) {
    showError(error);
    return;
  }
  showError(null);
  document.getElementById("model-name").textContent = model.id;
  const nav = document.getElementById("tabs");
  nav.replaceChildren();
  for (const [name, label, allowed, setup] of TABS) {
    if (!allowed(model)) continue;
    const button = Object.assign(document.createElement("button"), { textContent: label, type: "button" });
    button.dataset.tab = name;
    button.addEventListener("click", () => select(name));
    nav.append(button);
    setup(model);
  }
  const first = nav.querySelector("button");
  if (first) select(first.dataset.tab);
  else showError(`model ${model.id} has no output this playground shows`);
}

start();
