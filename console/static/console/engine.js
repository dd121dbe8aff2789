// Engine page: one snapshot every half second over /ws/console/engine; the charts keep the
// last five minutes of them (charts.js).
"use strict";
(function () {
  const LANE_COLORS = ["#d1242f", "#1f6feb", "#8250df"];
  const $ = (id) => document.getElementById(id);
  const fmt = (v, digits = 0) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));

  // Abbreviated on the card (1.2M), exact in its tooltip and data-value.
  function count(el, value) {
    el.textContent = abbrev(value);
    el.title = grouped(value);
    el.dataset.value = value;
  }

  function render(s) {
    $("engine-state").textContent = s.state;
    $("engine-state").className = "badge" + (s.ready ? " ready" : "");
    if (!s.ready) return;
    $("tokens-per-s").textContent = fmt(s.tokens_per_s, 1);
    count($("generated-tokens"), s.generated_tokens);
    count($("finished-requests"), s.finished_requests);
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

  const lanes = ["0", "1", "2"];
  const charts = {
    throughput: timeChart($("chart-throughput"), [{ label: "this replica", color: "#1f6feb" }], "tokens/s"),
    lanes: timeChart($("chart-lanes"), lanes.flatMap((l, i) => [
      { label: `P${l} running`, color: LANE_COLORS[i] },
      { label: `P${l} waiting`, color: LANE_COLORS[i], dash: [4, 3] },
    ]), "requests"),
    kv: timeChart($("chart-kv"), [{ label: "used", color: "#1f6feb" }, { label: "cached", color: "#8bb8f8" }], "blocks"),
    ttft: timeChart($("chart-ttft"), lanes.map((l, i) => ({ label: `P${l} p50`, color: LANE_COLORS[i] })), "ms"),
  };

  // Tokens/s of every replica that reports to the fleet, one series each. uPlot's series are
  // fixed when it is built, so a replica joining or leaving rebuilds the chart from the history.
  const FLEET_COLORS = ["#1f6feb", "#d1242f", "#2e9e44", "#8250df", "#9a6700", "#0e7c86", "#bf3989", "#57606a"];
  const fleetHistory = [];
  let fleetChart = null, fleetIds = "";

  function chartFleet(s) {
    if (!s.fleet) return;
    fleetHistory.push({ at: s.at, rates: Object.fromEntries(s.fleet.map((r) => [r.id, r.tokens_per_s])) });
    while (s.at - fleetHistory[0].at > 300) fleetHistory.shift();
    const ids = s.fleet.map((r) => r.id).sort();
    if (ids.join(" ") !== fleetIds || fleetChart === null) {
      fleetIds = ids.join(" ");
      $("chart-fleet").replaceChildren();
      fleetChart = timeChart($("chart-fleet"), ids.map((id, i) => ({ label: id, color: FLEET_COLORS[i % FLEET_COLORS.length] })),
                             "tokens/s");
      for (const h of fleetHistory.slice(0, -1)) fleetChart.push(h.at, ids.map((id) => h.rates[id] ?? null));
    }
    fleetChart.push(s.at, ids.map((id) => fleetHistory[fleetHistory.length - 1].rates[id] ?? null));
  }

  function chart(s) {
    charts.throughput.push(s.at, [s.tokens_per_s]);
    charts.lanes.push(s.at, lanes.flatMap((l) => [(s.lanes[l] || {}).running ?? 0, (s.lanes[l] || {}).waiting ?? 0]));
    charts.kv.push(s.at, [s.kv_blocks_used, s.kv_blocks_cached]);
    charts.ttft.push(s.at, lanes.map((l) => ((s.latency || {})[l] || {}).ttft_p50_ms ?? null));
  }

  function connect() {
    const socket = new WebSocket(`${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws/console/engine`);
    socket.onmessage = (event) => {
      const s = JSON.parse(event.data);
      render(s);
      renderFleet(s);
      if (s.ready) chart(s);
      chartFleet(s);
    };
    socket.onclose = (event) => {
      $("engine-state").textContent = event.code === 4403 ? "forbidden: log in as staff" : "disconnected, retrying…";
      $("engine-state").className = "badge";
      if (event.code !== 4403) setTimeout(connect, 2000);
    };
  }
  connect();
})();
