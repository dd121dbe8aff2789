// Playground: the page calls the public API the way a tenant's client would,
// POST /v1/chat/completions with stream: true, and reads the SSE body as it arrives.
// An error (refused request, an error event in the stream, finish_reason "error") is shown
// as an error, never as a finished reply.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const chat = $("chat");
  const messages = [];

  function line(cls, text) {
    const div = document.createElement("div");
    div.className = cls;
    div.textContent = text;
    $("transcript").appendChild(div);
    return div;
  }

  class ApiError extends Error {}

  // The request body from the form: only what the operator set, so the API's defaults apply otherwise.
  function requestBody() {
    const system = $("system-prompt").value.trim();
    const body = { messages: system ? [{ role: "system", content: system }, ...messages] : [...messages],
                   max_tokens: Number($("max-tokens").value), stream: true, stream_options: { include_usage: true },
                   priority: Number($("lane").value) };
    for (const [id, field] of [["temperature", "temperature"], ["top-p", "top_p"]]) {
      if ($(id).value !== "") body[field] = Number($(id).value);
    }
    const format = $("response-format").value;
    if (format === "json_object") body.response_format = { type: "json_object" };
    if (format === "json_schema") {
      let schema;
      try { schema = JSON.parse($("json-schema").value); } catch (err) { throw new ApiError(`The JSON schema does not parse: ${err.message}`); }
      body.response_format = { type: "json_schema", json_schema: { name: "playground", schema } };
    }
    return body;
  }

  // Each `data:` line of the SSE body, parsed, as it arrives.
  async function* events(response) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const row of event.split("\n")) {
          if (row.startsWith("data: ") && row !== "data: [DONE]") yield JSON.parse(row.slice(6));
        }
      }
    }
  }

  function rate(tokens, first) {
    const elapsed = first === null ? 0 : (performance.now() - first) / 1000;
    return elapsed > 0 && tokens > 1 ? ((tokens - 1) / elapsed).toFixed(1) : "–";
  }

  async function send(prompt) {
    messages.push({ role: "user", content: prompt });
    line("user", prompt);
    const out = line("assistant", "");
    document.querySelectorAll(".assistant").forEach((el) => el.removeAttribute("id"));
    out.id = "reply";
    for (const id of ["ttft", "tokens-per-s", "finish"]) $(id).textContent = "–";
    $("token-count").textContent = "0";
    $("send").disabled = true;
    const started = performance.now();
    let first = null, chunks = 0, usage = null, finish = null, text = "";
    try {
      const body = requestBody();
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", Authorization: `Bearer ${chat.dataset.key}` },
        body: JSON.stringify(body),
      });
      if (!response.ok) {
        const error = await response.json().catch(() => ({}));
        throw new ApiError(`${response.status}: ${(error.error && error.error.message) || response.statusText}`);
      }
      for await (const chunk of events(response)) {
        if (chunk.error) throw new ApiError(`stream error: ${chunk.error.message || JSON.stringify(chunk.error)}`);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const piece = (choice.delta && choice.delta.content) || "";
          if (piece) {
            if (first === null) { first = performance.now(); $("ttft").textContent = `${Math.round(first - started)} ms`; }
            text += piece; chunks += 1;
            out.textContent = text;
            $("token-count").textContent = String(chunks);
            $("tokens-per-s").textContent = rate(chunks, first);
          }
          if (choice.finish_reason) finish = choice.finish_reason;
          if (choice.finish_reason === "error") {
            throw new ApiError(`the reply ended in an error: ${(choice.error && choice.error.message) || "finish_reason error"}`);
          }
        }
      }
      if (finish === null) throw new ApiError("the stream ended without a finish reason");
      if (usage) {  // deltas can merge several tokens; the usage chunk has the exact count
        $("token-count").textContent = String(usage.completion_tokens);
        $("tokens-per-s").textContent = rate(usage.completion_tokens, first);
      }
      $("finish").textContent = finish;
      line("reply-stats hint", `TTFT ${$("ttft").textContent} · ${$("token-count").textContent} tokens · ${$("tokens-per-s").textContent} tokens/s · ${finish}`);
      messages.push({ role: "assistant", content: text });
    } catch (err) {
      out.textContent = text;
      const shown = line("error", `Error: ${err instanceof ApiError ? err.message : `the request failed (${err.message || err})`}`);
      shown.setAttribute("role", "alert");
      $("finish").textContent = "error";
      messages.pop();  // the failed turn is not sent again as context
    } finally {
      $("send").disabled = false;
    }
  }

  $("response-format").addEventListener("change", () => {
    $("json-schema-field").hidden = $("response-format").value !== "json_schema";
  });
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const prompt = $("prompt").value.trim();
    if (!prompt) return;
    $("prompt").value = "";
    send(prompt);
  });
})();
