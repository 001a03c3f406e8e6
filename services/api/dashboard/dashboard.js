"use strict";
// Polls /metrics, derives each panel's values from two scrapes `window` seconds apart (rates,
// histogram quantiles, mean step times), and pushes them into the charts. The latest values
// are on window.stokerDashboard for tests and for the curious (open the console).

(() => {
  const M = window.StokerMetrics;
  const { LineChart, BarChart, formatValue } = window.StokerCharts;
  const clamp = (v, lo, hi) => Math.min(hi, Math.max(lo, v));
  const params = new URLSearchParams(location.search);
  const intervalMs = clamp(Number(params.get("interval")) || 1000, 200, 60000);
  let windowS = clamp(Number(params.get("window")) || 5, 1, 600);
  const spanS = clamp(Number(params.get("span")) || 300, 10, 3600);  // the charts' time axis
  // Relative to the page, so a proxy that serves the api under a path prefix still works.
  const metricsUrl = `${location.pathname.replace(/\/dashboard\/?$/, "")}/metrics`;
  const KEY = "stoker-api-key";

  // #key=... : the fragment never reaches the server (or its access log). Kept for this tab
  // only, then taken out of the address bar.
  const fragment = new URLSearchParams(location.hash.slice(1));
  if (fragment.has("key")) {
    sessionStorage.setItem(KEY, fragment.get("key"));
    history.replaceState(null, "", location.pathname + location.search);
  }

  const STATE = { scrapes: 0, errors: 0, status: "starting", latest: {}, spec: false, forward: false, tokenizers: [] };
  window.stokerDashboard = STATE;

  const $ = (id) => document.getElementById(id);
  const chart = (id, options) => new LineChart($(`chart-${id}`), $(`legend-${id}`), { spanS, ...options });
  // The worker's wall time per step. Its forward part is the host's side of it where the server
  // exports that (on CUDA the device runs on while the host goes on to sampling, which waits).
  const WORKER_PARTS = [["worker_prepare", "prepare"], ["worker_forward_wall", "forward"],
    ["worker_sample", "sample"], ["worker_idle", "idle"]];
  const HOST_PARTS = [["schedule", "schedule"], ["plan_encode", "plan encode"],
    ["plan_ipc", "plan IPC"], ["result_ipc", "result IPC"], ["update", "update"]];
  const percentiles = [["p50", "p50"], ["p90", "p90"], ["p99", "p99"]];
  const charts = {
    requests: chart("requests", { unit: "/s", series: [{ key: "req_s", label: "finished" }] }),
    tokens: chart("tokens", { unit: "tok/s", series: [{ key: "out_tok_s", label: "output" },
      { key: "prompt_tok_s", label: "prompt" }] }),
    ttft: chart("ttft", { unit: "ms", series: percentiles.map(([k, l]) => ({ key: `ttft_${k}`, label: l })) }),
    itl: chart("itl", { unit: "ms", series: percentiles.map(([k, l]) => ({ key: `itl_${k}`, label: l })) }),
    queue: chart("queue", { series: [{ key: "running", label: "running" }, { key: "waiting", label: "waiting" }] }),
    kv: chart("kv", { unit: "%", yMin: 100, series: [{ key: "kv_usage", label: "KV usage" },
      { key: "prefix_hit", label: "prefix-cache hits" }] }),
    grammar: chart("grammar", { unit: "ms", series: [{ key: "step_grammar_mask", label: "mask fill" },
      { key: "step_grammar_wait", label: "sampling waited" }] }),
    spec: chart("spec", { unit: "%", yMin: 100, series: [{ key: "spec_accept", label: "accepted" }] }),
    worker: chart("worker", { unit: "ms", stacked: true,
      series: WORKER_PARTS.map(([k, l]) => ({ key: `step_${k}`, label: l })) }),
    host: chart("host", { unit: "ms", series: HOST_PARTS.map(([k, l]) => ({ key: `step_${k}`, label: l })) }),
    tokenizers: chart("tokenizers", { unit: "req/s", series: [] }),
    forward: chart("forward", { unit: "ms", series: [{ key: "step_worker_forward", label: "device" },
      { key: "step_worker_forward_host", label: "host" }] }),
    batch: chart("batch", { series: [{ key: "batch_tokens", label: "batch tokens" },
      { key: "batch_requests", label: "batch requests" }] }),
  };
  const positions = new BarChart($("chart-spec-pos"), { unit: "%", yMax: 100 });

  const recent = [];  // [{t, scrape}]: the last `windowS` seconds, and one more

  function derive(before, after, dt) {
    const a = before.scrape;
    const b = after.scrape;
    const v = (s, name, labels) => M.value(s, name, labels);
    const rate = (name) => M.rate(v(a, name), v(b, name), dt);
    const inc = (name) => M.increase(v(a, name), v(b, name));
    const out = {
      // No finished request yet means no labelled sample yet: a rate of 0, not a gap.
      req_s: M.rate(v(a, "stoker:request_success_total") ?? 0,
        v(b, "stoker:request_success_total") ?? 0, dt),
      out_tok_s: rate("stoker:generation_tokens_total"),
      prompt_tok_s: rate("stoker:prompt_tokens_total"),
      running: v(b, "stoker:num_requests_running"),
      waiting: v(b, "stoker:num_requests_waiting"),
      kv_usage: 100 * v(b, "stoker:kv_cache_usage_perc"),
      busy: 100 * v(b, "stoker:device_busy_fraction"),
      steps_s: rate("stoker:steps_total"),
    };
    const queries = inc("stoker:prefix_cache_queries_total");
    out.prefix_hit = queries > 0 ? (100 * inc("stoker:prefix_cache_hits_total")) / queries : NaN;
    for (const [key, family] of [["ttft", "stoker:time_to_first_token_seconds"],
      ["itl", "stoker:inter_token_latency_seconds"]]) {
      const observed = M.bucketDelta(M.buckets(a, family), M.buckets(b, family));
      for (const q of [50, 90, 99]) out[`${key}_p${q}`] = 1000 * M.quantile(q / 100, observed);
    }
    const timed = ["worker_prepare", "worker_forward", "worker_forward_host", "worker_sample",
      "worker_idle", "grammar_mask", "grammar_wait", ...HOST_PARTS.map(([name]) => name)];
    // Structured outputs (docs/structured-outputs.md): compiles and the compile cache's share.
    const compiled = (cache) => M.increase(v(a, "stoker:grammar_compiles_total", { cache }) ?? 0,
      v(b, "stoker:grammar_compiles_total", { cache }) ?? 0);
    const hits = compiled("hit");
    const misses = compiled("miss");
    out.grammar_hit = hits + misses > 0 ? (100 * hits) / (hits + misses) : NaN;
    const compiles = inc("stoker:grammar_compile_seconds_count");
    out.grammar_compile = compiles > 0 ? (1000 * inc("stoker:grammar_compile_seconds_sum")) / compiles : NaN;
    for (const name of timed) {
      const family = `stoker:step_${name}_seconds`;
      const n = inc(`${family}_count`);
      out[`step_${name}`] = n > 0 ? (1000 * inc(`${family}_sum`)) / n : NaN;
    }
    STATE.forward = b.samples.has("stoker:step_worker_forward_host_seconds_count");
    const forward = STATE.forward ? "worker_forward_host" : "worker_forward";
    out.step_worker_forward_wall = out[`step_${forward}`];
    // The device's share of the worker's wall time while it had work (docs/observability.md).
    const wall = ["worker_idle", "worker_prepare", forward, "worker_sample"]
      .reduce((sum, name) => sum + inc(`stoker:step_${name}_seconds_sum`), 0);
    out.fed = STATE.forward && wall > 0 ? (100 * inc("stoker:step_worker_forward_seconds_sum")) / wall : NaN;
    for (const name of ["batch_tokens", "batch_requests"]) {
      const n = inc(`stoker:step_${name}_count`);
      out[name] = n > 0 ? inc(`stoker:step_${name}_sum`) / n : NaN;
    }
    STATE.spec = b.samples.has("stoker:spec_decode_num_drafts_total");
    if (STATE.spec) {
      const drafted = inc("stoker:spec_decode_num_draft_tokens_total");
      const drafts = inc("stoker:spec_decode_num_drafts_total");
      const accepted = inc("stoker:spec_decode_num_accepted_tokens_total");
      out.spec_accept = drafted > 0 ? (100 * accepted) / drafted : NaN;
      out.spec_len = drafts > 0 ? (accepted + drafts) / drafts : NaN;
      const name = "stoker:spec_decode_num_accepted_tokens_per_pos_total";
      const was = M.byLabel(a, name, "position");
      for (const [pos, n] of M.byLabel(b, name, "position")) {
        out[`spec_pos_${pos}`] = drafts > 0 ? (100 * M.increase(was.get(pos) || 0, n)) / drafts : NaN;
      }
    }
    const name = "stoker:tokenizer_requests_total";
    const was = M.byLabel(a, name, "tokenizer");
    STATE.tokenizers = [...M.byLabel(b, name, "tokenizer").keys()].sort();
    for (const [tok, n] of M.byLabel(b, name, "tokenizer")) {
      out[`tokenizer:${tok}`] = was.has(tok) ? M.rate(was.get(tok), n, dt) : NaN;
    }
    return out;
  }

  function show(t, values) {
    STATE.latest = values;
    for (const tok of STATE.tokenizers) charts.tokenizers.ensureSeries(`tokenizer:${tok}`, tok);
    for (const c of Object.values(charts)) c.push(t, values);
    const posKeys = Object.keys(values).filter((k) => k.startsWith("spec_pos_"))
      .sort((x, y) => Number(x.slice(9)) - Number(y.slice(9)));
    positions.draw(posKeys.map((k) => ({ label: `#${k.slice(9)}`, value: values[k] })));
    $("panel-spec").classList.toggle("off", !STATE.spec);
    $("panel-forward").classList.toggle("off", !STATE.forward);
    $("grammar-note").textContent = `compile cache hits ${formatValue(values.grammar_hit, "%")}, ` +
      `mean compile ${formatValue(values.grammar_compile, "ms")} (tokenizer processes)`;
    $("forward-note").textContent = STATE.forward ? `device fed share ${formatValue(values.fed, "%")}`
      : "this server does not export the forward-pass split (stoker:step_worker_forward_host_seconds)";
    $("spec-note").textContent = STATE.spec
      ? `mean tokens per verify step ${formatValue(values.spec_len)}`
      : "speculative decoding is off (start with --speculative ngram|draft)";
    const tiles = { "tile-tok": [values.out_tok_s, "tok/s"], "tile-running": [values.running, ""],
      "tile-waiting": [values.waiting, ""], "tile-kv": [values.kv_usage, "%"],
      "tile-busy": [values.busy, "%"], "tile-steps": [values.steps_s, "/s"] };
    for (const [id, [v, unit]] of Object.entries(tiles)) $(id).textContent = formatValue(v, unit);
  }

  function ingest(t, scrape) {
    recent.push({ t, scrape });
    while (recent.length > 2 && recent[1].t <= t - windowS) recent.shift();
    STATE.scrapes += 1;
    if (recent.length < 2) return;
    const before = recent[0];
    show(t, derive(before, recent[recent.length - 1], t - before.t));
  }

  function setStatus(kind, text) {
    STATE.status = kind;
    $("status").className = `status ${kind}`;
    $("status-text").textContent = text;
  }

  let timer = null;
  async function poll() {
    timer = null;
    let delay = intervalMs;
    const key = sessionStorage.getItem(KEY);
    try {
      const r = await fetch(metricsUrl, {
        cache: "no-store",
        headers: key ? { Authorization: `Bearer ${key}` } : {},
      });
      if (r.status === 401) {
        askForKey(key ? "the server refused this API key" : "/metrics needs this server's API key");
        return;  // polling resumes when a key is entered
      }
      if (!r.ok) throw new Error(`${metricsUrl} answered ${r.status}`);
      ingest(Date.now() / 1000, M.parse(await r.text()));
      setStatus("live", `live · every ${intervalMs / 1000} s · rates and percentiles over ${windowS} s`);
    } catch (e) {
      STATE.errors += 1;
      setStatus("error", `${e.message} (retrying)`);
      delay = Math.min(intervalMs * 5, 10000);
    }
    timer = setTimeout(poll, delay);
  }

  function askForKey(reason) {
    setStatus("locked", reason);
    $("key-reason").textContent = reason;
    $("key-form").hidden = false;
    $("key-input").focus();
  }

  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, $("key-input").value);
    $("key-input").value = "";
    $("key-form").hidden = true;
    if (timer === null) poll();
  });

  const select = $("window");
  if (![...select.options].some((o) => Number(o.value) === windowS)) select.add(new Option(`${windowS} s`, windowS));
  select.value = String(windowS);
  select.addEventListener("change", () => { windowS = Number(select.value); });
  $("source").textContent = metricsUrl;
  poll();
})();
