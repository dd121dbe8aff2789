// Playground: the page calls the public API the way a tenant's client would,
// POST /v1/chat/completions with stream: true, and reads the SSE body as it arrives.
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

  async function send(prompt) {
    messages.push({ role: "user", content: prompt });
    line("user", prompt);
    const out = line("assistant", "");
    out.id = "reply";
    document.querySelectorAll(".assistant").forEach((el) => { if (el !== out) el.removeAttribute("id"); });
    for (const id of ["ttft", "tokens-per-s", "finish"]) $(id).textContent = "–";
    $("token-count").textContent = "0";
    $("send").disabled = true;
    const started = performance.now();
    let first = null, chunks = 0, usage = null, finish = null, text = "";
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", Authorization: `Bearer ${chat.dataset.key}` },
        body: JSON.stringify({ messages, max_tokens: Number($("max-tokens").value), stream: true,
                               stream_options: { include_usage: true } }),
      });
      if (!response.ok) {
        const body = await response.json().catch(() => ({}));
        throw new Error(`${response.status}: ${(body.error && body.error.message) || response.statusText}`);
      }
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          for (const row of event.split("\n")) {
            if (!row.startsWith("data: ") || row === "data: [DONE]") continue;
            const chunk = JSON.parse(row.slice(6));
            if (chunk.usage) usage = chunk.usage;
            for (const choice of chunk.choices || []) {
              const piece = (choice.delta && choice.delta.content) || "";
              if (piece) {
                if (first === null) { first = performance.now(); $("ttft").textContent = `${Math.round(first - started)} ms`; }
                text += piece; chunks += 1;
                out.textContent = text;
                $("token-count").textContent = String(chunks);
                const elapsed = (performance.now() - first) / 1000;
                if (elapsed > 0 && chunks > 1) $("tokens-per-s").textContent = ((chunks - 1) / elapsed).toFixed(1);
              }
              if (choice.finish_reason) finish = choice.finish_reason;
            }
          }
        }
      }
      if (usage) {
        // Deltas can merge several tokens; the usage chunk has the exact count.
        $("token-count").textContent = String(usage.completion_tokens);
        const elapsed = first === null ? 0 : (performance.now() - first) / 1000;
        if (elapsed > 0 && usage.completion_tokens > 1) $("tokens-per-s").textContent = ((usage.completion_tokens - 1) / elapsed).toFixed(1);
      }
      $("finish").textContent = finish || "done";
      messages.push({ role: "assistant", content: text });
    } catch (err) {
      out.textContent = text;
      line("error warn", String(err.message || err));
      $("finish").textContent = "error";
    } finally {
      $("send").disabled = false;
    }
  }

  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const prompt = $("prompt").value.trim();
    if (!prompt) return;
    $("prompt").value = "";
    send(prompt);
  });
})();
