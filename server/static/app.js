// The chat page: conversations kept in localStorage, settings, the server's status, and one
// streamed answer at a time with a stop button. Images picked with the Image button go with the
// next message as image_url parts (data URLs), for a vision model.
import { renderInline, renderMarkdown } from "./markdown.js";
import { ApiError, apiFetch, splitThink, streamChat } from "./stream.js";

const STORE = { conversations: "taper.conversations", current: "taper.current",
                settings: "taper.settings", apiKey: "taper.apiKey" };
const $ = (id) => document.getElementById(id);

function load(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

const state = {
  conversations: load(STORE.conversations, []),
  currentId: load(STORE.current, null),
  settings: { model: "", system: "", temperature: "", top_p: "", max_tokens: "",
              ...load(STORE.settings, {}) },
  apiKey: localStorage.getItem(STORE.apiKey) || "",
  running: null,          // {controller, reply} while an answer streams
  attachments: [],        // {name, url: a data URL} picked for the next message
  modelNotices: new Map(), // model id -> the one line the server gives about it (the demo's)
  nodes: new WeakMap(),   // message -> its DOM parts
  health: null,
};

// an answer that was streaming when the page went away ended there
for (const conv of state.conversations) {
  for (const m of conv.messages) if (m.status === "streaming") m.status = "stopped";
}

function save() {
  try {
    localStorage.setItem(STORE.conversations, JSON.stringify(state.conversations));
    localStorage.setItem(STORE.current, JSON.stringify(state.currentId));
  } catch (e) {      // images make conversations large: the browser's quota may be reached
    notify(`This conversation could not be stored in the browser (${e.name}); delete older ` +
           "conversations to make room");
  }
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// ---- notices

function notify(message, kind = "error") {
  const box = $("notice");
  box.textContent = message;
  box.className = kind;
  box.hidden = !message;
}

function showModelNotice(model) {
  const box = $("model-notice");
  const text = state.modelNotices.get(model) ?? "";
  box.textContent = text;
  box.hidden = !text;
}

// ---- conversations

function current() {
  return state.conversations.find((c) => c.id === state.currentId) ?? null;
}

function newConversation() {
  const conv = { id: crypto.randomUUID?.() ?? String(Date.now() + Math.random()),
                 title: "New chat", created: Date.now(), messages: [] };
  state.conversations.unshift(conv);
  state.currentId = conv.id;
  save();
  return conv;
}

function selectConversation(id) {
  document.body.classList.remove("sidebar-open");
  state.currentId = id;
  save();
  renderSidebar();
  renderConversation();
}

function deleteConversation(id) {
  if (state.running && state.running.conv.id === id) state.running.controller.abort();
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (state.currentId === id) state.currentId = state.conversations[0]?.id ?? null;
  save();
  renderSidebar();
  renderConversation();
}

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conv of state.conversations) {
    const item = list.appendChild(el("li", conv.id === state.currentId ? "active" : ""));
    const open = item.appendChild(el("button", "conv-title", conv.title));
    open.type = "button";
    open.title = conv.title;
    open.addEventListener("click", () => selectConversation(conv.id));
    const del = item.appendChild(el("button", "conv-delete", "\u00d7"));
    del.type = "button";
    del.title = "Delete this conversation";
    del.setAttribute("aria-label", `Delete conversation ${conv.title}`);
    del.addEventListener("click", () => deleteConversation(conv.id));
  }
}

// ---- messages

function messageNode(msg) {
  const node = el("article", `msg ${msg.role}`);
  node.append(el("div", "role", msg.role === "user" ? "You" : "Assistant"));
  const parts = { node };
  if (msg.role === "assistant") {
    parts.reasoning = node.appendChild(el("details", "reasoning"));
    parts.reasoningTitle = parts.reasoning.appendChild(el("summary", null, "Reasoning"));
    parts.reasoningBody = parts.reasoning.appendChild(el("div", "reasoning-body"));
    parts.reasoning.hidden = true;
    // the page opens and folds the reasoning itself until the user does
    parts.reasoning.addEventListener("toggle", () => {
      if (parts.reasoning.open !== parts.autoOpen) parts.userToggled = true;
    });
  }
  parts.body = node.appendChild(el("div", msg.role === "user" ? "body plain" : "body markdown"));
  parts.meta = node.appendChild(el("div", "meta"));
  state.nodes.set(msg, parts);
  updateMessage(msg);
  return node;
}

function markdown(text) {
  return renderMarkdown(text, document.createDocumentFragment());
}

function updateMessage(msg) {
  const parts = state.nodes.get(msg);
  if (!parts) return;
  if (msg.role === "user") {
    parts.body.textContent = msg.content;
    if (msg.images?.length) parts.body.prepend(imageStrip(msg.images));
    return;
  }
  const split = splitThink(msg.content);
  const reasoning = (msg.reasoning || "") + split.reasoning;
  const streaming = msg.status === "streaming";
  const thinking = streaming && (split.thinking || (Boolean(msg.reasoning) && !split.answer));
  parts.reasoning.hidden = !reasoning.trim();
  parts.reasoningTitle.textContent = thinking ? "Reasoning\u2026" : "Reasoning";
  parts.reasoningBody.replaceChildren(markdown(reasoning.trim()));
  if (!parts.userToggled) {
    parts.autoOpen = thinking;                // open while it thinks, folded once it answers
    parts.reasoning.open = thinking;
  }
  parts.body.replaceChildren(markdown(split.answer));
  if (streaming && !split.answer && !thinking) parts.body.append(el("span", "typing", "\u2026"));
  parts.node.classList.toggle("streaming", streaming);
  parts.meta.replaceChildren(...metaText(msg));
}

function imageStrip(images, onRemove) {
  const strip = el("div", "images");
  images.forEach((image, i) => {
    const figure = strip.appendChild(el("figure", "image"));
    const img = figure.appendChild(el("img"));
    img.src = image.url;
    img.alt = image.name;
    img.title = image.name;
    if (onRemove) {
      const remove = figure.appendChild(el("button", "remove", "\u00d7"));
      remove.type = "button";
      remove.setAttribute("aria-label", `Remove ${image.name}`);
      remove.addEventListener("click", () => onRemove(i));
    }
  });
  return strip;
}

function metaText(msg) {
  const out = [];
  if (msg.status === "stopped") out.push(el("span", "badge", "stopped"));
  if (msg.status === "error") out.push(el("span", "badge error", msg.error || "error"));
  if (msg.usage) {
    const seconds = msg.elapsed ? msg.elapsed / 1000 : 0;
    const perSecond = (msg.usage.completion_tokens / seconds).toFixed(1);
    const rate = seconds > 0 ? ` \u00b7 ${perSecond} tokens/s` : "";
    out.push(el("span", null, `${msg.usage.completion_tokens} tokens${rate}`));
  }
  if (msg.finishReason === "length") out.push(el("span", null, "cut at max tokens"));
  return out;
}

function renderConversation() {
  const box = $("messages");
  box.replaceChildren();
  const conv = current();
  $("chat-title").textContent = conv ? conv.title : "New chat";
  if (!conv || !conv.messages.length) {
    const empty = box.appendChild(el("div", "empty"));
    empty.append(el("h2", null, "Chat with the served model"));
    renderInline(
      "Answers stream in as they are generated; **Stop** ends one early. Set the system prompt, " +
      "sampling and API key under **Settings**. Conversations stay in this browser.",
      empty.appendChild(el("p")));
    return;
  }
  for (const msg of conv.messages) box.append(messageNode(msg));
  box.scrollTop = box.scrollHeight;
}

function scrollIfNear() {
  const box = $("messages");
  if (box.scrollHeight - box.scrollTop - box.clientHeight < 120) box.scrollTop = box.scrollHeight;
}

// ---- sending

function requestFor(conv) {
  const s = state.settings;
  const messages = [];
  if (s.system.trim()) messages.push({ role: "system", content: s.system });
  const past = conv.messages.filter((m) => m.status !== "streaming");
  past.forEach((m, i) => {
    // the answer alone goes back to the model (chat templates drop earlier reasoning); a
    // question whose answer failed is left out with it, so the roles still alternate
    const answer = (msg) => splitThink(msg.content).answer;
    if (m.role === "assistant" ? answer(m) : !(past[i + 1] && !answer(past[i + 1]))) {
      messages.push({ role: m.role, content: m.role === "assistant" ? answer(m) : userContent(m) });
    }
  });
  const request = { messages };
  if (s.model) request.model = s.model;
  for (const [key, parse] of [["temperature", parseFloat], ["top_p", parseFloat],
                              ["max_tokens", (v) => parseInt(v, 10)]]) {
    const value = parse(s[key]);
    if (Number.isFinite(value)) request[key] = value;
  }
  return request;
}

// A user message's content: its text, or its images' image_url parts then the text.
function userContent(msg) {
  if (!msg.images?.length) return msg.content;
  const parts = msg.images.map((image) => ({ type: "image_url", image_url: { url: image.url } }));
  if (msg.content.trim()) parts.push({ type: "text", text: msg.content });
  return parts;
}

function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren();
  box.hidden = !state.attachments.length;
  if (state.attachments.length) {
    box.append(imageStrip(state.attachments, (i) => {
      state.attachments.splice(i, 1);
      renderAttachments();
    }));
  }
}

function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attach(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) {
      notify(`${file.name} is not an image`);
      continue;
    }
    try {
      state.attachments.push({ name: file.name, url: await readAsDataURL(file) });
    } catch (e) {
      notify(`${file.name} could not be read: ${e.message}`);
    }
  }
  renderAttachments();
}

async function send(text) {
  const images = state.attachments;
  if (state.running || (!text.trim() && !images.length)) return;
  const conv = current() ?? newConversation();
  if (!conv.messages.length) {
    conv.title = (text.trim().split("\n")[0] || images[0].name).slice(0, 60);
  }
  conv.messages.push(images.length ? { role: "user", content: text, images }
                                   : { role: "user", content: text });
  state.attachments = [];
  renderAttachments();
  const request = requestFor(conv);
  const reply = { role: "assistant", content: "", reasoning: "", status: "streaming" };
  conv.messages.push(reply);
  save();
  renderSidebar();
  renderConversation();
  notify("");

  const controller = new AbortController();
  state.running = { controller, reply, conv };
  setRunning(true);
  const started = performance.now();
  let frame = 0;
  const redraw = () => {
    frame = 0;
    updateMessage(reply);
    scrollIfNear();
  };
  try {
    const { finishReason, usage } = await streamChat(request, {
      apiKey: state.apiKey, signal: controller.signal,
      onDelta: ({ content, reasoning }) => {
        reply.content += content;
        reply.reasoning += reasoning;
        frame ||= requestAnimationFrame(redraw);      // at most one redraw per frame
      },
    });
    reply.status = "done";
    reply.finishReason = finishReason;
    reply.usage = usage;
    reply.elapsed = performance.now() - started;
  } catch (e) {
    if (e.name === "AbortError") {
      reply.status = "stopped";
    } else {
      reply.status = "error";
      reply.error = e instanceof ApiError ? e.message : `Unexpected error: ${e.message}`;
      notify(reply.error);
      if (e.status === 503) watchHealth();   // loading or draining: show it, poll until ready
    }
  } finally {
    cancelAnimationFrame(frame);
    state.running = null;
    setRunning(false);
    save();
    updateMessage(reply);
    scrollIfNear();
  }
}

function setRunning(running) {
  $("send").hidden = running;
  $("stop").hidden = !running;
  $("prompt").dataset.running = running ? "yes" : "no";
}

// ---- settings and server status

function bindSettings() {
  const fields = { model: "model", system: "system", temperature: "temperature", top_p: "top-p",
                   max_tokens: "max-tokens" };
  for (const [key, id] of Object.entries(fields)) {
    const input = $(id);
    input.value = state.settings[key];
    input.addEventListener("input", () => {
      state.settings[key] = input.value;
      localStorage.setItem(STORE.settings, JSON.stringify(state.settings));
    });
  }
  const key = $("api-key");
  key.value = state.apiKey;
  key.addEventListener("change", () => {
    state.apiKey = key.value.trim();
    if (state.apiKey) localStorage.setItem(STORE.apiKey, state.apiKey);
    else localStorage.removeItem(STORE.apiKey);
    notify("");
    loadModels();
  });
}

async function loadModels() {
  const select = $("model");
  try {
    const resp = await apiFetch("/v1/models", { apiKey: state.apiKey });
    const models = (await resp.json()).data;
    const names = models.map((m) => m.id);
    // Taper's extra `notice` field on a model object (the random-weight demo has one)
    state.modelNotices = new Map(
      models.filter((m) => typeof m.notice === "string").map((m) => [m.id, m.notice]));
    const keep = names.includes(state.settings.model) ? state.settings.model : names[0] ?? "";
    select.replaceChildren(...names.map((n) => el("option", null, n)));
    select.value = keep;
    state.settings.model = keep;
    $("model-name").textContent = keep;
    showModelNotice(keep);
  } catch (e) {
    select.replaceChildren(el("option", null, "(unavailable)"));
    $("model-name").textContent = "";
    showModelNotice("");
    notify(e.message);
    if (e.status === 401) openSettings(true);
  }
}

const HEALTH_TEXT = { ok: "ready", loading: "loading the model\u2026",
                      "shutting down": "shutting down", "engine stopped": "engine stopped" };
let healthTimer = 0;

async function checkHealth() {
  let status;
  try {
    status = (await (await fetch("/health")).json()).status;
  } catch {
    status = "unreachable";
  }
  const pill = $("server-status");
  pill.textContent = HEALTH_TEXT[status] ?? status;
  pill.dataset.status = status;
  const was = state.health;
  state.health = status;
  if (status === "loading") {
    notify("The model is still loading; you can send once it is ready.", "info");
  } else if (status === "shutting down") {
    notify("The server is shutting down (draining): it takes no new requests.", "warn");
  } else if (status === "engine stopped") {
    notify("The server's engine has stopped: it cannot answer (its log says why).");
  } else if (status === "unreachable") {
    notify("Cannot reach the server: is it running?");
  } else if (was && was !== "ok" && status === "ok") {
    notify("");
    loadModels();
  }
  return status;
}

function watchHealth() {
  clearTimeout(healthTimer);
  const tick = async () => {
    const status = await checkHealth();
    healthTimer = setTimeout(tick, status === "ok" ? 15000 : 2000);
  };
  tick();
}

function openSettings(open) {
  document.body.classList.toggle("settings-open", open);
}

// ---- start

function start() {
  bindSettings();
  renderSidebar();
  renderConversation();
  setRunning(false);
  $("new-chat").addEventListener("click", () => {
    state.currentId = null;                   // created with its first message
    document.body.classList.remove("sidebar-open");
    save();
    renderSidebar();
    renderConversation();
    $("prompt").focus();
  });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const prompt = $("prompt");
    if (state.running || (!prompt.value.trim() && !state.attachments.length)) return;
    const text = prompt.value;
    prompt.value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.running?.controller.abort());
  $("attach").addEventListener("click", () => $("image-file").click());
  $("image-file").addEventListener("change", async (e) => {
    await attach([...e.target.files]);
    e.target.value = "";         // the same file can be picked again
  });
  $("toggle-settings").addEventListener("click", () =>
    openSettings(!document.body.classList.contains("settings-open")));
  $("close-settings").addEventListener("click", () => openSettings(false));
  $("toggle-sidebar").addEventListener("click", (e) => {
    e.stopPropagation();
    document.body.classList.toggle("sidebar-open");
  });
  $("chat").addEventListener("click", () => document.body.classList.remove("sidebar-open"));
  $("model").addEventListener("change", () => {
    $("model-name").textContent = $("model").value;
    showModelNotice($("model").value);
  });
  watchHealth();
  loadModels();
  $("prompt").focus();
}

start();
