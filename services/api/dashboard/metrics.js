"use strict";
// The Prometheus text format, parsed, and what the dashboard derives from two scrapes of it:
// counter rates and histogram quantiles over the window between them. Pure functions (no DOM),
// so the tests call them in the browser through window.StokerMetrics.

const StokerMetrics = (() => {
  function parseValue(text) {
    if (text === "+Inf" || text === "Inf") return Infinity;
    if (text === "-Inf") return -Infinity;
    if (text === "NaN") return NaN;
    const value = Number(text);
    if (text === "" || Number.isNaN(value)) throw new Error(`bad sample value ${JSON.stringify(text)}`);
    return value;
  }

  // Reads `{a="x",b="y"}` starting at line[i] === "{" into labels; returns the index after "}".
  function parseLabels(line, i, labels) {
    i += 1;
    for (;;) {
      while (line[i] === " " || line[i] === ",") i += 1;
      if (line[i] === "}") return i + 1;
      const eq = line.indexOf("=", i);
      if (eq < 0) throw new Error(`bad labels in ${JSON.stringify(line)}`);
      const name = line.slice(i, eq).trim();
      i = eq + 1;
      while (line[i] === " ") i += 1;
      if (line[i] !== '"') throw new Error(`unquoted label value in ${JSON.stringify(line)}`);
      i += 1;
      let value = "";
      for (;;) {
        const c = line[i];
        if (c === undefined) throw new Error(`unterminated label value in ${JSON.stringify(line)}`);
        if (c === "\\") {
          const next = line[i + 1];
          value += next === "n" ? "\n" : next;
          i += 2;
        } else if (c === '"') {
          i += 1;
          break;
        } else {
          value += c;
          i += 1;
        }
      }
      labels[name] = value;
    }
  }

  // text -> {samples: Map(sample name -> [{labels, value}]), types: Map(family -> type)}.
  function parse(text) {
    const samples = new Map();
    const types = new Map();
    for (const raw of text.split("\n")) {
      const line = raw.trim();
      if (line === "") continue;
      if (line[0] === "#") {
        const m = /^#\s+TYPE\s+(\S+)\s+(\S+)/.exec(line);
        if (m) types.set(m[1], m[2]);
        continue;
      }
      let i = 0;
      while (i < line.length && line[i] !== "{" && line[i] !== " " && line[i] !== "\t") i += 1;
      const name = line.slice(0, i);
      const labels = {};
      if (line[i] === "{") i = parseLabels(line, i, labels);
      const fields = line.slice(i).trim().split(/\s+/);  // value, then an optional timestamp
      const value = parseValue(fields[0]);
      if (!samples.has(name)) samples.set(name, []);
      samples.get(name).push({ labels, value });
    }
    return { samples, types };
  }

  function matches(labels, want) {
    return Object.entries(want).every(([k, v]) => labels[k] === v);
  }

  // Sum of the samples of `name` whose labels include `want`; undefined when there are none.
  function value(scrape, name, want = {}) {
    const rows = (scrape.samples.get(name) || []).filter((r) => matches(r.labels, want));
    return rows.length ? rows.reduce((a, r) => a + r.value, 0) : undefined;
  }

  // label value -> sample value, summed over the other labels.
  function byLabel(scrape, name, label) {
    const out = new Map();
    for (const r of scrape.samples.get(name) || []) {
      const key = r.labels[label];
      if (key !== undefined) out.set(key, (out.get(key) || 0) + r.value);
    }
    return out;
  }

  // A histogram's cumulative buckets as [[le, count], ...] sorted by le (+Inf last).
  function buckets(scrape, family) {
    const byLe = byLabel(scrape, `${family}_bucket`, "le");
    return [...byLe.entries()].map(([le, n]) => [parseValue(le), n]).sort((a, b) => a[0] - b[0]);
  }

  // Observations between two scrapes, bucket by bucket. A restarted server (counts went down)
  // counts from zero, as Prometheus's increase() does.
  function bucketDelta(before, after) {
    const prev = new Map(before);
    const out = after.map(([le, n]) => [le, n - (prev.get(le) || 0)]);
    return out.some(([, n]) => n < 0) ? after : out;
  }

  // Prometheus's histogram_quantile: the bucket holding rank q * total, interpolated linearly
  // inside it; the lowest bucket starts at 0; a rank in +Inf reports the highest finite bound.
  // NaN without observations.
  function quantile(q, cumulative) {
    if (!cumulative.length) return NaN;
    const total = cumulative[cumulative.length - 1][1];
    if (!(total > 0)) return NaN;
    const rank = q * total;
    let lower = 0;
    let below = 0;
    for (const [le, count] of cumulative) {
      if (count >= rank) {
        if (le === Infinity) return lower;
        if (count === below) return le;
        return lower + ((le - lower) * (rank - below)) / (count - below);
      }
      lower = le;
      below = count;
    }
    return lower;
  }

  // Per-second rate of a counter between two scrapes dt seconds apart (a reset counts from 0).
  function rate(before, after, dt) {
    if (before === undefined || after === undefined || !(dt > 0)) return NaN;
    return (after >= before ? after - before : after) / dt;
  }

  // Increase of a counter between two scrapes (a reset counts from 0).
  function increase(before, after) {
    if (before === undefined || after === undefined) return NaN;
    return after >= before ? after - before : after;
  }

  return { parse, parseValue, value, byLabel, buckets, bucketDelta, quantile, rate, increase };
})();

window.StokerMetrics = StokerMetrics;
