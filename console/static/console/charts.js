// A minimal line chart on <canvas>: the console vendors no chart library.
// series: [{values: [number|null], color, dashed}] over the same x positions (oldest first).
"use strict";
function drawLines(canvas, series, { min = 0 } = {}) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 28;
  ctx.clearRect(0, 0, w, h);
  const all = series.flatMap((s) => s.values.filter((v) => v !== null && v !== undefined));
  const max = Math.max(1, ...all);
  ctx.strokeStyle = "#ccd"; ctx.fillStyle = "#667"; ctx.font = "11px sans-serif"; ctx.lineWidth = 1;
  ctx.beginPath(); ctx.moveTo(pad, 4); ctx.lineTo(pad, h - 12); ctx.lineTo(w, h - 12); ctx.stroke();
  ctx.fillText(String(Math.round(max)), 2, 12); ctx.fillText(String(min), 2, h - 14);
  for (const s of series) {
    const n = s.values.length;
    if (n < 2) continue;
    ctx.strokeStyle = s.color; ctx.lineWidth = 1.5; ctx.setLineDash(s.dashed ? [4, 3] : []);
    ctx.beginPath();
    let drawing = false;
    s.values.forEach((v, i) => {
      if (v === null || v === undefined) { drawing = false; return; }
      const x = pad + (i / (n - 1)) * (w - pad - 2);
      const y = h - 12 - ((v - min) / (max - min || 1)) * (h - 20);
      if (drawing) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      drawing = true;
    });
    ctx.stroke();
  }
  ctx.setLineDash([]);
}
