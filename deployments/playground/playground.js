// Tandem's playground: streams from the app's own OpenAI API with spec_trace on, and colours each
// token by where it came from. Model text only ever goes into the page through textContent.
"use strict";

const $ = (id) => document.getElementById(id);
let running = null;  // the AbortController of the call in flight

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();  // only ever in this page's memory and this header
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function status(text, isError = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", isError);
}

async function errorText(response) {
  try {
    const body = await response.json();
    return `${response.status}: ${body.error.message}`;
  } catch (_) {
    return `${response.status} ${response.statusText}`;
  }
}

async function loadModels() {
  const select = $("model");
  try {
    const r = await fetch("v1/models", { headers: headers() });
    if (!r.ok) {
      status(r.status === 401 ? "This server needs an API key: type it above." : await errorText(r), true);
      return;
    }
    const models = (await r.json()).data;
    select.replaceChildren(...models.map((m) => {
      const o = document.createElement("option");
      o.value = o.textContent = m.id;
      return o;
    }));
    status("");
  } catch (e) {
    status("The server did not answer: " + e.message, true);
  }
}

function body(speculative) {
  const num = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  const stop = $("stop").value.replaceAll("\\n", "\n");
  const b = {
    model: $("model").value,
    stream: true,
    spec_trace: true,
    speculative,
    temperature: num("temperature"),
    top_p: num("top_p"),
    max_tokens: num("max_tokens"),
    seed: num("seed"),
    stop: stop ? [stop] : undefined,
  };
  if ($("mode").value === "chat") b.messages = [{ role: "user", content: $("prompt").value }];
  else b.prompt = $("prompt").value;
  return b;
}

// One streamed answer, drawn into `out` as it comes: text is cut into the tokens' spans by their
// `end` offsets; a token whose text has not arrived yet waits for it.
class AnswerView {
  constructor(out) {
    this.out = out;
    this.text = "";
    this.tokens = [];  // spec_trace entries not drawn yet
    this.drawn = 0;  // characters of text already in spans
    this.count = { tokens: 0, drafts: 0, rounds: 0, drafting: 0, k: null };
    out.replaceChildren();
  }

  add(text, trace) {
    this.text += text;
    for (const t of trace ? trace.tokens : []) {
      this.tokens.push(t);
      this.count.tokens += 1;
      if (t.draft) this.count.drafts += 1;
      else {
        this.count.rounds += 1;
        if (t.k > 0) { this.count.drafting += 1; this.count.k = t.k; }
      }
    }
    this.draw(false);
  }

  draw(final) {
    while (this.tokens.length && (this.tokens[0].end <= this.text.length || final)) {
      const t = this.tokens.shift();
      const end = Math.min(t.end, this.text.length);
      const span = document.createElement("span");
      span.className = "tok " + (t.draft ? "draft" : "target");
      span.dataset.round = t.round;
      span.title = `round ${t.round}` + (t.draft ? ": a draft token the target accepted"
        : t.k > 0 ? `: the target's own token, after ${t.k} drafts proposed` : ": the target's own token");
      span.textContent = this.text.slice(this.drawn, Math.max(end, this.drawn));
      this.drawn = Math.max(end, this.drawn);
      this.out.append(span);
    }
    if (final && this.drawn < this.text.length) {  // text no token claims (none should)
      const rest = document.createElement("span");
      rest.textContent = this.text.slice(this.drawn);
      this.out.append(rest);
      this.drawn = this.text.length;
    }
  }

  meanAcceptanceLength() {  // 1 + accepted drafts / rounds that drafted (vLLM's definition)
    return this.count.drafting ? 1 + this.count.drafts / this.count.drafting : null;
  }
}

function showStrip(view, times, stats) {
  const c = view.count;
  const decoding = times.last - times.first;
  $("m-rate").textContent = c.tokens > 1 && decoding > 0 ? ((c.tokens - 1) / (decoding / 1000)).toFixed(1) : "–";
  $("m-ttft").textContent = times.first ? `${Math.round(times.first - times.start)} ms` : "–";
  const mal = stats ? (stats.num_drafts ? stats.mean_acceptance_length : null) : view.meanAcceptanceLength();
  $("m-mal").textContent = mal === null ? "no drafts" : mal.toFixed(2);
  $("m-k").textContent = c.k === null ? "–" : String(c.k);
  $("m-tokens").textContent = String(c.tokens);
  $("m-drafts").textContent = String(stats ? stats.num_accepted_tokens : c.drafts);
}

// Reads an SSE body, calling onEvent with each `data:` JSON until [DONE].
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

// One call; returns {text, ms, stats} or throws with the API's message.
async function run(speculative, out, live) {
  const view = new AnswerView(out);
  const times = { start: performance.now(), first: 0, last: 0 };
  let stats = null;
  running = new AbortController();
  const r = await fetch($("mode").value === "chat" ? "v1/chat/completions" : "v1/completions",
    { method: "POST", headers: headers(), body: JSON.stringify(body(speculative)), signal: running.signal });
  if (!r.ok) throw new Error(await errorText(r));
  await readEvents(r, (chunk) => {
    if (chunk.error) throw new Error(chunk.error.message);
    const choice = chunk.choices[0];
    if (!choice) return;
    const text = (choice.delta ? (choice.delta.reasoning_content || "") + (choice.delta.content || "") : choice.text) || "";
    const trace = choice.spec_trace;
    if (trace && trace.tokens.length) {
      times.last = performance.now();
      if (!times.first) times.first = times.last;
    }
    if (trace && trace.stats) stats = trace.stats;
    view.add(text, trace);
    if (live) showStrip(view, times, stats);
  });
  view.draw(true);
  if (live) showStrip(view, times, stats);
  return { text: view.text, ms: performance.now() - times.start, stats };
}

async function guarded(task) {
  for (const b of ["send", "compare"]) $(b).disabled = true;
  $("cancel").disabled = false;
  status("Generating…");
  try {
    await task();
    status("");
  } catch (e) {
    status(e.name === "AbortError" ? "Stopped." : e.message, e.name !== "AbortError");
  } finally {
    running = null;
    for (const b of ["send", "compare"]) $(b).disabled = false;
    $("cancel").disabled = true;
  }
}

function send() {
  $("pane-plain").hidden = true;
  $("compare-note").hidden = true;
  $("time-spec").textContent = $("time-plain").textContent = "";
  return guarded(async () => {
    const spec = await run(true, $("answer-spec"), true);
    $("time-spec").textContent = `${(spec.ms / 1000).toFixed(2)} s`;
  });
}

function compare() {
  $("pane-plain").hidden = false;
  $("compare-note").hidden = true;
  $("answer-plain").replaceChildren();
  $("time-spec").textContent = $("time-plain").textContent = "";
  return guarded(async () => {
    // one after the other: run side by side they would share the machine and both be slower
    const spec = await run(true, $("answer-spec"), true);
    $("time-spec").textContent = `${(spec.ms / 1000).toFixed(2)} s`;
    const plain = await run(false, $("answer-plain"), false);
    $("time-plain").textContent = `${(plain.ms / 1000).toFixed(2)} s`;
    const note = $("compare-note");
    const greedy = Number($("temperature").value) === 0;
    const speedup = `Speculation took ${(spec.ms / plain.ms).toFixed(2)}× the time of the target alone ` +
      `(${(plain.ms / spec.ms).toFixed(2)}× the speed).`;
    if (spec.text === plain.text) {
      note.textContent = `Identical text${greedy ? " (greedy: speculation changes how fast, never what)" : ""}. ${speedup}`;
      note.className = "same";
    } else {
      note.textContent = (greedy ? "The texts differ, though decoding was greedy. "
        : "The texts differ: sampled at temperature > 0, each run draws its own answer (set temperature 0 to compare). ") + speedup;
      note.className = greedy ? "differ" : "";
    }
    note.hidden = false;
  });
}

// Hovering a token lights up its whole round.
function highlightRound(event) {
  const t = event.target.closest(".tok[data-round]");
  const pane = event.currentTarget;
  for (const s of pane.querySelectorAll(".tok.lit")) s.classList.remove("lit");
  if (!t) return;
  for (const s of pane.querySelectorAll(`.tok[data-round="${t.dataset.round}"]`)) s.classList.add("lit");
}

document.addEventListener("DOMContentLoaded", () => {
  $("send").addEventListener("click", send);
  $("compare").addEventListener("click", compare);
  $("cancel").addEventListener("click", () => running && running.abort());
  $("api-key").addEventListener("change", loadModels);
  for (const id of ["answer-spec", "answer-plain"]) {
    $(id).addEventListener("mouseover", highlightRound);
    $(id).addEventListener("mouseleave", highlightRound);
  }
  loadModels();
});
