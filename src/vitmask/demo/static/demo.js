// vitmask demo: the page. It holds all the state (the image, the mask, the last result); the server
// computes each answer from what a request carries. Images are S*S binary pixels (1 = foreground,
// drawn white), sent as strings of '0'/'1' row by row; the mask the same way (1 = hidden: every patch
// holding a masked pixel is filled, as vitmask inpaint --mask reads a mask image).
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  info: null, S: 0, P: 0, G: 0, N: 0, scale: 1,
  image: null, mask: null, history: [],
  result: null, frame: 0, timer: null,
  stroke: null, examplesStart: 0, examplesTotal: 0,
  drawn: "", version: 0,  // the image as last drawn (bits); a count of the changes of the image and the result
};

// ---- messages and requests --------------------------------------------------------------------------
function say(text, isError = false) {
  const m = $("message");
  m.textContent = text;
  m.className = isError ? "error" : "";
}

async function api(path, body, raw = false) {
  const options = body === undefined ? {} : {
    method: "POST",
    body: raw ? body : JSON.stringify(body),
    headers: { "Content-Type": raw ? "application/octet-stream" : "application/json" },
  };
  let res;
  try {
    res = await fetch(path, options);
  } catch (e) {
    throw new Error("the demo server does not answer; is vitmask demo still running?");
  }
  let data = null;
  try {
    data = await res.json();
  } catch (e) {
    throw new Error(`the server answered ${res.status} ${res.statusText}`);
  }
  if (!res.ok) throw new Error(data && data.error ? data.error : `the server answered ${res.status}`);
  return data;
}

async function busy(button, what, work) {
  button.disabled = true;
  say(what + "…");
  try {
    await work();
  } catch (e) {
    say(e.message, true);
  } finally {
    button.disabled = false;
  }
}

// ---- pixels -----------------------------------------------------------------------------------------
const toBits = (a) => Array.from(a, (v) => (v ? "1" : "0")).join("");
const fromBits = (s) => Uint8Array.from(s, (c) => (c === "1" ? 1 : 0));
const patchOf = (x, y) => Math.floor(y / state.P) * state.G + Math.floor(x / state.P);

function hiddenPatches(mask) {
  const hidden = new Uint8Array(state.N);
  for (let y = 0; y < state.S; y++)
    for (let x = 0; x < state.S; x++) if (mask[y * state.S + x]) hidden[patchOf(x, y)] = 1;
  return hidden;
}

function snapshot() {
  state.history.push({ image: state.image.slice(), mask: state.mask.slice() });
  if (state.history.length > 100) state.history.shift();
}

// ---- the image canvas -------------------------------------------------------------------------------
// The classify bars describe one image: they go as soon as another is on the canvas (drawn, erased,
// undone, cleared, picked, uploaded, a result used) or a new fill or sample is shown beside them.
function canvasChanged() {
  state.version++;
  $("top").replaceChildren();
  $("classify-command").textContent = "";
}

function drawImage() {
  const c = $("image-canvas"), g = c.getContext("2d"), { S, P, scale } = state;
  const bits = toBits(state.image);
  if (bits !== state.drawn) {  // every change of the image is drawn: here it is seen
    state.drawn = bits;
    canvasChanged();
  }
  g.fillStyle = "#000";
  g.fillRect(0, 0, c.width, c.height);
  g.fillStyle = "#fff";
  for (let i = 0; i < S * S; i++) if (state.image[i]) g.fillRect((i % S) * scale, Math.floor(i / S) * scale, scale, scale);
  const hidden = hiddenPatches(state.mask);
  g.fillStyle = "rgba(42, 110, 255, 0.55)";
  for (let k = 0; k < state.N; k++)
    if (hidden[k]) g.fillRect((k % state.G) * P * scale, Math.floor(k / state.G) * P * scale, P * scale, P * scale);
  if (state.G <= 64 && scale * P >= 6) {  // the patch grid, faintly
    g.strokeStyle = "rgba(128, 128, 128, 0.25)";
    g.lineWidth = 1;
    g.beginPath();
    for (let k = 1; k < state.G; k++) {
      g.moveTo(k * P * scale + 0.5, 0); g.lineTo(k * P * scale + 0.5, c.height);
      g.moveTo(0, k * P * scale + 0.5); g.lineTo(c.width, k * P * scale + 0.5);
    }
    g.stroke();
  }
  if (state.stroke && state.stroke.tool === "box" && state.stroke.end) {
    const [x0, y0, x1, y1] = boxOf(state.stroke);
    g.strokeStyle = "#ffd400";
    g.setLineDash([4, 3]);
    g.strokeRect(x0 * scale + 0.5, y0 * scale + 0.5, (x1 - x0 + 1) * scale - 1, (y1 - y0 + 1) * scale - 1);
    g.setLineDash([]);
  }
}

function pixelAt(event) {
  const r = $("image-canvas").getBoundingClientRect();
  const x = Math.floor(((event.clientX - r.left) / r.width) * state.S);
  const y = Math.floor(((event.clientY - r.top) / r.height) * state.S);
  return [Math.min(state.S - 1, Math.max(0, x)), Math.min(state.S - 1, Math.max(0, y))];
}

function stamp(x, y, tool) {
  const size = Number($("brush-size").value), lo = -Math.floor((size - 1) / 2);
  for (let dy = lo; dy < lo + size; dy++)
    for (let dx = lo; dx < lo + size; dx++) {
      const px = x + dx, py = y + dy;
      if (px < 0 || py < 0 || px >= state.S || py >= state.S) continue;
      const i = py * state.S + px;
      if (tool === "pen") state.image[i] = 1;
      else if (tool === "eraser") state.image[i] = 0;
      else if (tool === "brush") state.mask[i] = 1;
      else if (tool === "unmask") state.mask[i] = 0;
    }
}

function line(x0, y0, x1, y1, tool) {  // Bresenham: every pixel between two pointer positions
  const dx = Math.abs(x1 - x0), dy = -Math.abs(y1 - y0), sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
  let err = dx + dy;
  for (;;) {
    stamp(x0, y0, tool);
    if (x0 === x1 && y0 === y1) break;
    const e2 = 2 * err;
    if (e2 >= dy) { err += dy; x0 += sx; }
    if (e2 <= dx) { err += dx; y0 += sy; }
  }
}

const boxOf = (s) => [Math.min(s.start[0], s.end[0]), Math.min(s.start[1], s.end[1]),
  Math.max(s.start[0], s.end[0]), Math.max(s.start[1], s.end[1])];

function wireDrawing() {
  const c = $("image-canvas");
  c.addEventListener("pointerdown", (e) => {
    if (e.button !== 0) return;
    c.setPointerCapture(e.pointerId);
    const tool = document.querySelector("input[name=tool]:checked").value, p = pixelAt(e);
    snapshot();
    state.stroke = { tool, start: p, last: p, end: p };
    if (tool !== "box") stamp(p[0], p[1], tool);
    drawImage();
  });
  c.addEventListener("pointermove", (e) => {
    if (!state.stroke) return;
    const p = pixelAt(e), s = state.stroke;
    if (s.tool === "box") s.end = p;
    else line(s.last[0], s.last[1], p[0], p[1], s.tool);
    s.last = p;
    drawImage();
  });
  const end = () => {
    const s = state.stroke;
    if (!s) return;
    if (s.tool === "box") {  // every pixel of the box, both corners included: the patches it touches
      const [x0, y0, x1, y1] = boxOf(s);
      for (let y = y0; y <= y1; y++) for (let x = x0; x <= x1; x++) state.mask[y * state.S + x] = 1;
    }
    state.stroke = null;
    drawImage();
  };
  c.addEventListener("pointerup", end);
  c.addEventListener("pointercancel", end);
}

function setImage(pixels, clearMask = true) {
  snapshot();
  state.image = pixels;
  if (clearMask) state.mask = new Uint8Array(state.S * state.S);
  drawImage();
}

// ---- saving PNGs (model resolution: the files the CLI reads) ----------------------------------------
function savePng(pixels, name) {
  const c = document.createElement("canvas");
  c.width = c.height = state.S;
  const g = c.getContext("2d"), img = g.createImageData(state.S, state.S);
  for (let i = 0; i < pixels.length; i++) {
    const v = pixels[i] ? 255 : 0;
    img.data.set([v, v, v, 255], 4 * i);
  }
  g.putImageData(img, 0, 0);
  c.toBlob((blob) => {
    const a = document.createElement("a");
    a.href = URL.createObjectURL(blob);
    a.download = name;
    document.body.appendChild(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 10000);
  }, "image/png");
}

// ---- results: a fill or a sample, and its rounds ----------------------------------------------------
function showResult(kind, input, hidden, data, command) {
  const fixedAt = new Int32Array(state.N).fill(-1), prob = new Float32Array(state.N);
  data.rounds.forEach((r, t) => r.patches.forEach((k, j) => { fixedAt[k] = t; prob[k] = r.probability[j]; }));
  stopPlaying();
  canvasChanged();
  state.result = { kind, input, hidden, pixels: fromBits(data.pixels), rounds: data.rounds, fixedAt, prob };
  const slider = $("round");
  slider.max = String(data.rounds.length);
  slider.disabled = data.rounds.length < 2;
  $("play").disabled = data.rounds.length < 2;
  $("use-result").disabled = $("save-result").disabled = false;
  $("command").textContent = command;
  setFrame(data.rounds.length);
}

function setFrame(f) {  // T: the rounds that ran, each fixing at least one patch (min(steps, hidden patches))
  state.frame = f;
  $("round").value = String(f);
  const T = state.result.rounds.length, fixed = f > 0 ? state.result.rounds[f - 1].patches.length : 0;
  $("round-text").textContent = f === 0 ? `before round 1 of ${T}` : `round ${f} of ${T}: ${fixed} patch${fixed === 1 ? "" : "es"} fixed`;
  drawResult();
}

function drawResult() {
  const c = $("result-canvas"), g = c.getContext("2d"), { S, P, G, scale } = state, r = state.result;
  g.fillStyle = "#000";
  g.fillRect(0, 0, c.width, c.height);
  const heat = $("heat").checked;
  c.dataset.tint = heat ? "on" : "off";  // the confidence overlay: off until its checkbox is ticked
  if (!r) return;
  const f = state.frame;
  for (let i = 0; i < S * S; i++) {
    const k = patchOf(i % S, Math.floor(i / S));
    const waiting = r.hidden[k] && !(r.fixedAt[k] >= 0 && r.fixedAt[k] < f);
    if (waiting) g.fillStyle = "#808080";
    else if (r.pixels[i]) g.fillStyle = "#fff";
    else continue;
    g.fillRect((i % S) * scale, Math.floor(i / S) * scale, scale, scale);
  }
  for (let k = 0; k < state.N; k++) {
    if (!(r.fixedAt[k] >= 0 && r.fixedAt[k] < f)) continue;
    const x = (k % G) * P * scale, y = Math.floor(k / G) * P * scale;
    if (heat) {
      g.fillStyle = `hsla(${Math.round(120 * r.prob[k])}, 90%, 45%, 0.5)`;
      g.fillRect(x, y, P * scale, P * scale);
    }
    if (r.fixedAt[k] === f - 1 && f < r.rounds.length) {  // fixed in the round shown
      g.strokeStyle = "#ffd400";
      g.lineWidth = 2;
      g.strokeRect(x + 1, y + 1, P * scale - 2, P * scale - 2);
    }
  }
}

function stopPlaying() {
  if (state.timer) clearInterval(state.timer);
  state.timer = null;
  $("play").textContent = "▶ play";
}

function play() {
  if (state.timer) return stopPlaying();
  const T = state.result.rounds.length;
  if (state.frame >= T) setFrame(0);
  $("play").textContent = "❚❚ pause";
  state.timer = setInterval(() => {
    setFrame(state.frame + 1);
    if (state.frame >= T) stopPlaying();
  }, Math.max(60, Math.min(600, 4000 / T)));
}

function describePatch(e) {
  const r = state.result;
  if (!r) return "";
  const c = $("result-canvas").getBoundingClientRect();
  const x = Math.floor(((e.clientX - c.left) / c.width) * state.S), y = Math.floor(((e.clientY - c.top) / c.height) * state.S);
  if (x < 0 || y < 0 || x >= state.S || y >= state.S) return "";
  const k = patchOf(x, y), where = `patch ${k} (row ${Math.floor(k / state.G)}, column ${k % state.G})`;
  if (!r.hidden[k]) return `${where}: visible`;
  return `${where}: filled in round ${r.fixedAt[k] + 1}, p = ${r.prob[k].toFixed(3)}`;
}

// ---- reading the controls ----------------------------------------------------------------------------
function number(id, name, integer) {
  const text = $(id).value.trim(), v = Number(text);
  if (text === "" || !Number.isFinite(v) || (integer && !Number.isSafeInteger(v)))
    throw new Error(`${name} must be ${integer ? "an integer" : "a number"}, got '${text}'`);
  return v;
}

function decodeOptions(prefix) {
  return {
    steps: number(prefix + "-steps", "steps", true),
    temperature: number(prefix + "-temperature", "temperature", false),
    seed: number(prefix + "-seed", "seed", true),
    order: $(prefix + "-order").value,
    choice_temperature: number(prefix + "-choice", "choice temperature", false),
  };
}

function shellWord(s) {
  return /^[\w@%+=:,./-]+$/.test(s) ? s : "'" + s.replace(/'/g, "'\\''") + "'";
}

function optionsText(o) {
  return `--temperature ${o.temperature} --seed ${o.seed} --order ${o.order} --choice-temperature ${o.choice_temperature}`;
}

// ---- actions -------------------------------------------------------------------------------------------
async function fill() {
  await busy($("fill"), "filling", async () => {
    const o = decodeOptions("fill"), iterative = $("fill-iterative").checked;
    const input = state.image.slice(), mask = state.mask.slice();
    const data = await api("/api/fill", { pixels: toBits(input), mask: toBits(mask), iterative, ...o });
    const steps = iterative ? ` --iterative --steps ${o.steps}` : "";
    const command = `vitmask inpaint --checkpoint ${shellWord(state.info.model.name)} --image image.png --mask mask.png `
      + `--out filled.png${steps} ${optionsText(o)}`;
    showResult("fill", input, hiddenPatches(mask), data, command);
    const T = data.rounds.length, fewer = iterative && o.steps > T ? ` (steps ${o.steps}: one round a patch at most)` : "";
    say(`filled ${data.filled_patches} of ${data.patches} patches in ${T} round${T === 1 ? "" : "s"}${fewer}`);
    if (data.rounds.length > 1) play();
  });
}

async function sample() {
  await busy($("sample"), "sampling", async () => {
    const o = decodeOptions("sample");
    const data = await api("/api/sample", o);
    const command = `vitmask sample --checkpoint ${shellWord(state.info.model.name)} --n 1 --steps ${o.steps} `
      + `${optionsText(o)} --out sample.png`;
    showResult("sample", new Uint8Array(state.S * state.S), new Uint8Array(state.N).fill(1), data, command);
    const T = data.rounds.length, fewer = o.steps > T ? ` (steps ${o.steps}: one round a patch at most)` : "";
    say(`sampled a new image in ${T} round${T === 1 ? "" : "s"}${fewer}`);
    if (data.rounds.length > 1) play();
  });
}

async function classify() {
  await busy($("classify"), "classifying", async () => {
    const k = number("top-k", "top-k", true), version = state.version;
    const data = await api("/api/classify", { pixels: toBits(state.image), top_k: k });
    if (state.version !== version) {  // the image or the result changed while it was classified
      say("the image or the result changed while the image was being classified; classify it again");
      return;
    }
    const list = $("top");
    list.replaceChildren();
    for (const t of data.top) {
      const li = document.createElement("li"), name = document.createElement("span");
      const track = document.createElement("span"), bar = document.createElement("span"), p = document.createElement("span");
      li.dataset.name = t.name;
      li.dataset.probability = String(t.probability);
      name.className = "name"; name.textContent = t.name; name.title = `class ${t.name} (label ${t.label})`;
      track.className = "track"; bar.className = "bar"; bar.style.display = "block";
      bar.style.width = `${(100 * t.probability).toFixed(2)}%`;
      track.appendChild(bar);
      p.className = "p"; p.textContent = `${(100 * t.probability).toFixed(1)}%`;
      li.append(name, track, p);
      list.appendChild(li);
    }
    $("classify-command").textContent = `vitmask predict --checkpoint ${shellWord(state.info.classifier.name)} `
      + `--input image.png --out top.json --top-k ${k}`;
    say(`classified: ${data.top[0].name} (p = ${data.top[0].probability.toFixed(3)})`);
  });
}

// the server's words for a file over its limit (app.upload_too_large), said before the file is sent
function sizeText(n) {
  return n >= 1 << 20 ? `${(n / (1 << 20)).toFixed(0)} MiB` : `${(n / 1024).toFixed(0)} KiB`;
}

async function upload(file) {
  await busy($("upload"), "reading " + file.name, async () => {
    const limit = state.info.limits.upload_bytes;
    if (file.size > limit)
      throw new Error(`the image is over ${sizeText(limit)}, the largest upload the demo reads; choose a smaller one`);
    const data = await api("/api/upload", file, true);
    setImage(fromBits(data.pixels));
    say(data.note ? `${file.name}: ${data.note}` : `${file.name} read`);
  });
}

// ---- test images ------------------------------------------------------------------------------------
async function loadExamples(start) {
  const data = await api(`/api/examples?start=${start}&count=24`);
  state.examplesTotal = data.total;
  if (!data.total) return;
  state.examplesStart = data.start;
  $("examples-panel").hidden = false;
  $("examples-panel").title = data.source;
  const box = $("examples"), thumb = Math.max(1, Math.floor(40 / state.S));
  box.replaceChildren();
  data.images.forEach((bits, j) => {
    const b = document.createElement("button"), c = document.createElement("canvas"), px = fromBits(bits);
    c.width = c.height = state.S;
    c.style.width = c.style.height = `${state.S * thumb}px`;
    const g = c.getContext("2d"), img = g.createImageData(state.S, state.S);
    px.forEach((v, i) => img.data.set([v * 255, v * 255, v * 255, 255], 4 * i));
    g.putImageData(img, 0, 0);
    b.title = `test image ${data.start + j}`;
    b.dataset.index = String(data.start + j);
    b.appendChild(c);
    b.addEventListener("click", () => { setImage(px.slice()); say(`test image ${data.start + j}`); });
    box.appendChild(b);
  });
  const end = data.start + data.images.length;
  $("examples-range").textContent = `${data.start + 1}–${end} of ${data.total}`;
  $("examples-prev").disabled = data.start === 0;
  $("examples-next").disabled = end >= data.total;
}

// ---- start ----------------------------------------------------------------------------------------------
function fillOrders(id, orders, chosen) {
  const s = $(id);
  for (const o of orders) {
    const opt = document.createElement("option");
    opt.value = opt.textContent = o;
    s.appendChild(opt);
  }
  s.value = chosen;
}

async function start() {
  let info;
  try {
    info = await api("/api/info");
  } catch (e) {
    say(e.message, true);
    return;
  }
  const m = info.model;
  Object.assign(state, { info, S: m.image_size, P: m.patch_size, G: m.image_size / m.patch_size, N: m.patches });
  state.scale = Math.max(1, Math.floor(336 / state.S));
  state.image = new Uint8Array(state.S * state.S);
  state.mask = new Uint8Array(state.S * state.S);
  for (const id of ["image-canvas", "result-canvas"]) $(id).width = $(id).height = state.S * state.scale;
  $("models").textContent = `${m.name}: ${m.image_size}x${m.image_size} images, ${m.patch_size}x${m.patch_size} patches`
    + (info.classifier ? `; classifier ${info.classifier.name} (${info.classifier.classes.length} classes)` : "; no classifier");
  for (const [prefix, values] of [["fill", info.fill], ["sample", info.sample]]) {
    $(prefix + "-steps").value = values.steps;
    $(prefix + "-temperature").value = values.temperature;
    $(prefix + "-seed").value = values.seed;
    $(prefix + "-choice").value = values.choice_temperature;
    fillOrders(prefix + "-order", info.orders, values.order);
  }
  $("fill-iterative").checked = info.fill.iterative;
  if (info.classifier) {
    $("classify-panel").hidden = false;
    $("top-k").value = info.classifier.top_k;
    $("top-k").max = info.classifier.classes.length;
    $("classify").addEventListener("click", classify);
  }
  wireDrawing();
  $("undo").addEventListener("click", () => {
    const last = state.history.pop();
    if (last) { state.image = last.image; state.mask = last.mask; drawImage(); }
  });
  $("clear-image").addEventListener("click", () => { snapshot(); state.image.fill(0); drawImage(); });
  $("clear-mask").addEventListener("click", () => { snapshot(); state.mask.fill(0); drawImage(); });
  $("save-image").addEventListener("click", () => savePng(state.image, "image.png"));
  $("save-mask").addEventListener("click", () => savePng(state.mask, "mask.png"));
  $("save-result").addEventListener("click", () => state.result && savePng(state.result.pixels, `${state.result.kind === "fill" ? "filled" : "sample"}.png`));
  $("use-result").addEventListener("click", () => state.result && setImage(state.result.pixels.slice()));
  $("upload").addEventListener("change", (e) => { const f = e.target.files[0]; e.target.value = ""; if (f) upload(f); });
  $("fill").addEventListener("click", fill);
  $("sample").addEventListener("click", sample);
  $("play").addEventListener("click", play);
  $("round").addEventListener("input", (e) => { stopPlaying(); setFrame(Number(e.target.value)); });
  $("heat").addEventListener("change", drawResult);
  $("result-canvas").addEventListener("mousemove", (e) => { $("result-canvas").title = describePatch(e); });
  $("examples-prev").addEventListener("click", () => loadExamples(Math.max(0, state.examplesStart - 24)).catch((e) => say(e.message, true)));
  $("examples-next").addEventListener("click", () => loadExamples(state.examplesStart + 24).catch((e) => say(e.message, true)));
  drawImage();
  drawResult();
  say("draw, pick a test image or upload one; mask patches; fill, sample or classify");
  document.body.dataset.ready = "1";
  loadExamples(0).catch((e) => say(e.message, true));
}

document.addEventListener("DOMContentLoaded", start);
