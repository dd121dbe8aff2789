// Numbers and time-series charts for the console's pages. Charts are uPlot (vendored under
// vendor/uplot/, v1.6.32, MIT): a time axis, a legend that reads the hovered instant, units
// on the axis, and a tooltip beside the cursor. Nothing is fetched from another origin.
"use strict";
const UNITS = [[1e12, "T"], [1e9, "B"], [1e6, "M"], [1e3, "k"]];

// 1234 -> "1.2k", 1000000000000 -> "1T": one decimal below 10 of a unit, none above.
function abbrev(value) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  const v = Number(value);
  for (const [size, suffix] of UNITS) {
    if (Math.abs(v) >= size * 0.9995) {  // so 999,999 reads 1M, not 1000k
      const scaled = v / size;
      return `${scaled.toFixed(Math.abs(scaled) < 10 ? 1 : 0).replace(/\.0$/, "")}${suffix}`;
    }
  }
  return Number.isInteger(v) ? String(v) : v.toFixed(v < 10 ? 1 : 0);
}

// 1234567 -> "1,234,567" (the exact figure, where the page has room for it).
const grouped = (value) => (value === null || value === undefined ? "–" : Number(value).toLocaleString("en-US"));

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

// A tooltip that follows the cursor and lists each series' value at that instant.
function tooltipPlugin(unit, xValue) {
  let tip;
  return {
    hooks: {
      init: (u) => {
        tip = document.createElement("div");
        tip.className = "tooltip";
        tip.setAttribute("role", "status");
        u.over.appendChild(tip);
      },
      setCursor: (u) => {
        const i = u.cursor.idx;
        if (i === null || i === undefined) { tip.style.display = "none"; return; }
        const when = xValue(u.data[0][i]);
        const rows = u.series.slice(1).map((s, k) => `${s.label}: ${abbrev(u.data[k + 1][i])} ${unit}`);
        tip.textContent = [when, ...rows].join("\n");
        tip.style.display = "block";
        tip.style.left = `${Math.min(u.cursor.left + 12, u.over.clientWidth - tip.offsetWidth)}px`;
        tip.style.top = `${Math.max(0, u.cursor.top - tip.offsetHeight - 8)}px`;
      },
    },
  };
}

function chartOptions(series, unit, { width, height, xValue }) {
  const axis = { stroke: cssVar("--hint"), grid: { stroke: cssVar("--line") }, ticks: { stroke: cssVar("--line") } };
  return {
    width, height,
    series: [{ label: "time", value: (u, t) => (t === null ? "–" : xValue(t)) },
             ...series.map((s) => ({ label: s.label, stroke: s.color, fill: s.fill, dash: s.dash, width: 1.5,
                                     ...(s.paths ? { paths: s.paths, points: { show: false } } : {}),
                                     value: (u, v) => (v === null || v === undefined ? "–" : `${abbrev(v)} ${unit}`) }))],
    axes: [{ ...axis }, { ...axis, label: unit, size: 56, values: (u, ticks) => ticks.map(abbrev) }],
    scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(1, max)] } },
    plugins: [tooltipPlugin(unit, xValue)],
  };
}

const clock = (t) => new Date(t * 1000).toLocaleTimeString("en-GB");
const day = (t) => new Date(t * 1000).toISOString().slice(0, 10);

// A live time-series chart in `figure`: series [{label, color, dash}], values in `unit`.
// Returns {push(t, values)}: one new instant (t in seconds), dropping what is older than windowS.
function timeChart(figure, series, unit, { windowS = 300, width = 560, height = 180 } = {}) {
  const data = [[], ...series.map(() => [])];
  const plot = new uPlot(chartOptions(series, unit, { width, height, xValue: clock }), data, figure);
  return {
    push(t, values) {
      data[0].push(t);
      values.forEach((v, i) => data[i + 1].push(v === undefined ? null : v));
      while (data[0].length && t - data[0][0] > windowS) data.forEach((column) => column.shift());
      plot.setData(data);
    },
  };
}

// Bars per day: days are each day's start (Unix seconds, UTC), series [{label, color, values}].
function dayChart(figure, days, series, unit, { width = 600, height = 180 } = {}) {
  const bars = series.map((s) => ({ ...s, fill: s.color, paths: uPlot.paths.bars({ size: [0.7, 40] }) }));
  return new uPlot(chartOptions(bars, unit, { width, height, xValue: day }), [days, ...series.map((s) => s.values)], figure);
}
