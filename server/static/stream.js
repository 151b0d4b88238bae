// Talking to the OpenAI-compatible API from the browser: a chat completion streamed over SSE
// (fetch + ReadableStream, so an AbortController can stop it and the server then aborts the
// request), errors turned into sentences a person can act on, and the reasoning split from the
// answer.

export class ApiError extends Error {
  constructor(message, status = 0, code = null) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

// What to tell the user for an error response (OpenAI's {"error": {"message", "code", ...}}).
export function describeError(status, body, hasKey) {
  const error = (body && body.error) || {};
  const detail = error.message || (typeof body === "string" ? body : "");
  if (status === 401) {
    return hasKey
      ? `The server refused the API key (401). Check the key under Settings. ${detail}`
      : `This server needs an API key (401): enter it under Settings. ${detail}`;
  }
  if (status === 503 && error.code === "model_loading") {
    return "The model is still loading; try again in a few seconds.";
  }
  if (status === 503 && error.code === "shutting_down") {
    return "The server is shutting down (draining): it takes no new requests.";
  }
  if (status === 429) return `The server is busy (429): ${detail || "retry shortly"}`;
  return `The server answered ${status || "an error"}: ${detail || "no details given"}`;
}

export async function apiFetch(path, { apiKey, body, signal } = {}) {
  const headers = {};
  if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let resp;
  try {
    resp = await fetch(path, {
      method: body === undefined ? "GET" : "POST", headers, signal,
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError("Cannot reach the server: is it running?");
  }
  if (!resp.ok) {
    const text = await resp.text();
    let parsed = text;
    try { parsed = JSON.parse(text); } catch { /* not JSON: keep the text */ }
    throw new ApiError(describeError(resp.status, parsed, Boolean(apiKey)), resp.status,
                       parsed?.error?.code ?? null);
  }
  return resp;
}

// The data fields of a server-sent event stream, one string per event.
export async function* sseData(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer = (buffer + decoder.decode(value, { stream: true })).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(l.startsWith("data: ") ? 6 : 5)).join("\n");
      if (data) yield data;
    }
  }
}

// Stream one chat completion; onDelta({content, reasoning}) per chunk. Resolves with
// {finishReason, usage}; rejects with ApiError, or an AbortError when `signal` fires.
export async function streamChat(request, { apiKey, signal, onDelta }) {
  const resp = await apiFetch("/v1/chat/completions", {
    apiKey, signal, body: { ...request, stream: true, stream_options: { include_usage: true } },
  });
  let finishReason = null;
  let usage = null;
  for await (const data of sseData(resp.body)) {
    if (data === "[DONE]") return { finishReason, usage };
    const chunk = JSON.parse(data);
    if (chunk.error) {        // an error after the stream started (e.g. aborted by a drain)
      throw new ApiError(`The server stopped this answer: ${chunk.error.message}`, 0,
                         chunk.error.code);
    }
    if (chunk.usage) usage = chunk.usage;
    const choice = chunk.choices?.[0];
    if (!choice) continue;
    const delta = choice.delta || {};
    // vLLM and SGLang send reasoning as reasoning_content; newer servers as reasoning
    const reasoning = delta.reasoning_content ?? delta.reasoning ?? "";
    if (delta.content || reasoning) onDelta({ content: delta.content || "", reasoning });
    if (choice.finish_reason) finishReason = choice.finish_reason;
  }
  throw new ApiError("The connection closed before the answer ended.");
}

// Split text that carries its reasoning inline as <think>...</think>. Models whose chat
// template opens the <think> itself (Qwen3, DeepSeek-R1) emit only the closing tag.
export function splitThink(text) {
  const open = text.match(/^\s*<think>/);
  const closeAt = text.indexOf("</think>");
  if (open) {
    const rest = text.slice(open[0].length);
    const end = rest.indexOf("</think>");
    return end < 0 ? { reasoning: rest, answer: "", thinking: true }
      : { reasoning: rest.slice(0, end), answer: rest.slice(end + 8).replace(/^\s+/, ""),
          thinking: false };
  }
  if (closeAt >= 0) {
    return { reasoning: text.slice(0, closeAt),
             answer: text.slice(closeAt + 8).replace(/^\s+/, ""), thinking: false };
  }
  // a tag still arriving ("<thi") is not shown as answer text
  if (/^\s*<(t(h(i(nk?)?)?)?)?$/.test(text) && text.trim()) {
    return { reasoning: "", answer: "", thinking: true };
  }
  return { reasoning: "", answer: text, thinking: false };
}
