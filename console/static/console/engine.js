// Engine page: one snapshot every half second over /ws/console/engine; the last five
// minutes of them are kept here, in the page, for the charts.
"use strict";
(function () {
  const HISTORY_S = 300;
  const LANE_COLORS = ["#d1242f", "#1f6feb", "#8250df"];
  const history = [];
  const $ = (id) => document.getElementById(id);
  const fmt = (v, digits = 0) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));

  function render(s) {
    $("engine-state").textContent = s.state;
    $("engine-state").className = "badge" + (s.ready ? " ready" : "");
    if (!s.ready) return;
    $("tokens-per-s").textContent = fmt(s.tokens_per_s, 1);
    $("generated-tokens").textContent = s.generated_tokens;
    $("finished-requests").textContent = s.finished_requests;
    $("requests-in-flight").textContent = s.requests_in_flight;
    $("preemptions").textContent = s.preemptions;
    $("preemptions-by-mode").textContent = `recompute ${s.preemptions_by_mode.recompute}, swap ${s.preemptions_by_mode.swap}`;
    $("kv-blocks").textContent = `${s.kv_blocks_used} used · ${s.kv_blocks_cached} cached · ${s.kv_blocks_free} free of ${s.kv_blocks_total}`;
    $("kv-meter-used").style.width = `${(100 * s.kv_blocks_used) / s.kv_blocks_total}%`;
    $("kv-meter-cached").style.width = `${(100 * s.kv_blocks_cached) / s.kv_blocks_total}%`;
    $("swap-blocks").textContent = `${s.swap_blocks_used} of ${s.swap_blocks_total} blocks`;
    $("swap-meter").style.width = `${(100 * s.swap_blocks_used) / (s.swap_blocks_total || 1)}%`;
    for (const lane of ["0", "1", "2"]) {
      const row = $(`lane-${lane}`);
      const counts = s.lanes[lane] || {};
      const latency = (s.latency || {})[lane] || {};
      for (const cell of row.querySelectorAll("td[data-field]")) {
        const field = cell.dataset.field;
        if (field in latency) cell.textContent = field.endsWith("_ms") ? (latency[field] === null ? "–" : `${fmt(latency[field])} ms`) : latency[field];
        else cell.textContent = counts[field] ?? 0;
      }
    }
  }

  function renderFleet(s) {
    const body = $("replicas").tBodies[0];
    const foot = $("replicas").tFoot.rows[0];
    body.replaceChildren();
    for (const cell of foot.cells) cell.textContent = "";
    const rows = s.fleet;  // null: Redis did not answer
    if (!rows || !rows.length) {
      const cell = body.insertRow().insertCell();
      cell.colSpan = 8;
      cell.textContent = rows ? "no replica has reported" : "the fleet is unavailable (Redis does not answer)";
      return;
    }
    for (const r of rows) {
      const row = body.insertRow();
      row.dataset.replica = r.id;
      const age = Math.max(0, s.at - r.last_seen);
      for (const text of [r.id, r.url, r.state, fmt(r.requests_running), fmt(r.requests_in_flight), fmt(r.tokens_per_s, 1),
                          r.kv_blocks_total ? `${r.kv_blocks_used} of ${r.kv_blocks_total}` : "–", `${fmt(age, 1)} s ago`]) {
        row.insertCell().textContent = text;
      }
    }
    // The fleet's totals, summed as GET /api/v1/engine/fleet sums them.
    const sum = (key) => rows.reduce((total, r) => total + (r[key] || 0), 0);
    const ready = rows.filter((r) => r.state === "ready").length;
    for (const [i, text] of [`all ${rows.length}`, "", `${ready} ready`, fmt(sum("requests_running")), fmt(sum("requests_in_flight")),
                             fmt(sum("tokens_per_s"), 1), `${sum("kv_blocks_used")} of ${sum("kv_blocks_total")}`, ""].entries()) {
      foot.cells[i].textContent = text;
    }
  }

  function chart() {
    const lane = (l, key) => history.map((s) => (s.lanes[l] || {})[key] ?? 0);
    drawLines($("chart-throughput"), [{ values: history.map((s) => s.tokens_per_s), color: "#1f6feb" }]);
    drawLines($("chart-lanes"), ["0", "1", "2"].flatMap((l, i) => [
      { values: lane(l, "running"), color: LANE_COLORS[i] },
      { values: lane(l, "waiting"), color: LANE_COLORS[i], dashed: true },
    ]));
    drawLines($("chart-kv"), [
      { values: history.map((s) => s.kv_blocks_used), color: "#1f6feb" },
      { values: history.map((s) => s.kv_blocks_cached), color: "#8bb8f8" },
    ]);
    drawLines($("chart-ttft"), ["0", "1", "2"].map((l, i) => ({
      values: history.map((s) => ((s.latency || {})[l] || {}).ttft_p50_ms ?? null), color: LANE_COLORS[i],
    })));
  }

  function connect() {
    const socket = new WebSocket(`${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws/console/engine`);
    socket.onmessage = (event) => {
      const s = JSON.parse(event.data);
      render(s);
      renderFleet(s);
      if (!s.ready) return;
      history.push(s);
      while (history.length && s.at - history[0].at > HISTORY_S) history.shift();
      chart();
    };
    socket.onclose = (event) => {
      $("engine-state").textContent = event.code === 4403 ? "forbidden: log in as staff" : "disconnected, retrying…";
      $("engine-state").className = "badge";
      if (event.code !== 4403) setTimeout(connect, 2000);
    };
  }
  connect();
})();
