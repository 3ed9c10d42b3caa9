/* The explorer's single-page app: every page is rendered here from the data files in data/
 * (see pipelines/explorer/data.py for their format). Routes:
 *   #/             each layer's best ranked circuits, then every output feature of every layer, sortable
 *                  and filterable
 *   #/layer/L      distributions over layer L and its best circuit candidates (pairs, group gates)
 *   #/out/L/F      output feature F of layer L (site mlp_out)
 *   #/in/L/F       input feature F of layer L (the input SAE's site)
 * with ?in=SITE choosing the input SAE's site when the run has several.
 * Every piece of text from the tables goes through esc() before it reaches the page. */
"use strict";
(function () {
  const D = (window.BCX_DATA = window.BCX_DATA || {});
  const main = document.getElementById("main");
  const meta = D.meta || { layers: [], input_sites: [], missing: {}, present: [], counts: [], lowrank: {},
                           hosvd: {}, run: "?" };
  const OUT = meta.output_site;  // the one output site (circuits.sites.OUTPUT_SITE)
  const timings = (window.BCX_TIMINGS = []);
  const state = { site: meta.input_sites[0] || meta.default_input_site, routeToken: 0,
                  index: { q: "", layer: "all", gatesOnly: false, minCorr: "", sort: null, desc: false, limit: 200 } };
  const HEATMAP_PAIRS = 12;
  const DIVERGING = [[0, "#2166ac"], [0.25, "#67a9cf"], [0.5, "#f7f7f7"], [0.75, "#ef8a62"], [1, "#b2182b"]];

  // ------------------------------------------------------------------ text and numbers

  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  function esc(s) { return s === null || s === undefined ? "" : String(s).replace(/[&<>"']/g, (c) => ESCAPES[c]); }
  function isNum(v) { return typeof v === "number" && isFinite(v); }
  function fmt(v, digits) {
    if (!isNum(v)) return v === null || v === undefined || typeof v === "number" ? "–" : esc(v);
    if (Number.isInteger(v)) return String(v);
    return String(Number(v.toPrecision(digits || 4)));
  }
  function pct(v) { return isNum(v) ? (100 * v).toFixed(1) + "%" : "–"; }
  /* A share as a percentage with two significant digits below 1% (0.0001063 -> 0.011%). */
  function pctReadable(v) {
    if (!isNum(v)) return "–";
    const p = 100 * v;
    return (p === 0 || Math.abs(p) >= 1 ? p.toFixed(1) : String(Number(p.toPrecision(2)))) + "%";
  }
  function trunc(s, n) { s = s || ""; return s.length > n ? s.slice(0, n - 1) + "…" : s; }
  function toInt(s) { return /^-?\d+$/.test(s || "") ? parseInt(s, 10) : NaN; }

  /* A context with its active token in [brackets]: the bracketed token marked, all escaped. */
  function context(text) {
    text = text || "";
    const m = /\[(\]|[^\]]+)\]/.exec(text);
    if (!m) return esc(text);
    return esc(text.slice(0, m.index)) + '<mark>' + esc(m[1]) + "</mark>" + esc(text.slice(m.index + m[0].length));
  }

  // ------------------------------------------------------------------ data

  const pending = {};
  function loadScript(src, ready) {
    return new Promise((resolve) => {
      const s = document.createElement("script");
      s.src = src;
      s.onload = () => resolve(ready());
      s.onerror = () => resolve(null);
      document.head.appendChild(s);
    });
  }
  function need(name) {
    if (name in D) return Promise.resolve(D[name]);
    return (pending[name] = pending[name] || loadScript("data/" + name + ".js", () => (name in D ? D[name] : null)));
  }
  /* A data file of one layer and input site (circuits, verdicts, samples): none when the run
   * has no circuit tables for that site (the file was not written: asking would log an error). */
  function needSite(file, layer) {
    return meta.input_sites.indexOf(state.site) >= 0 ? need(`${file}_L${layer}_${state.site}`) : Promise.resolve(null);
  }
  function needPlotly() {
    if (window.Plotly) return Promise.resolve(window.Plotly);
    if (!meta.plotly) return Promise.resolve(null);
    return (pending.$plotly = pending.$plotly || loadScript("static/plotly.min.js", () => window.Plotly || null));
  }

  /* A columnar table with its category codes decoded (once). */
  function T(t) {
    if (!t) return null;
    if (!t._decoded) {
      for (const [c, labels] of Object.entries(t.categories || {})) {
        t.columns[c] = t.columns[c].map((k) => (k < 0 ? null : labels[k]));
      }
      t._decoded = true;
      t._groups = {};
    }
    return t;
  }
  function col(t, name) { return (t && t.columns[name]) || null; }
  function val(t, name, i) { const c = col(t, name); return c ? c[i] : null; }
  /* Row indices of `t` whose column `key` equals `value` (a map built once per column). */
  function rowsOf(t, key, value) {
    if (!t) return [];
    let g = t._groups[key];
    if (!g) {
      g = t._groups[key] = new Map();
      const c = col(t, key) || [];
      for (let i = 0; i < c.length; i++) {
        const list = g.get(c[i]);
        if (list) list.push(i); else g.set(c[i], [i]);
      }
    }
    return g.get(value) || [];
  }
  function rec(t, i) { const r = {}; for (const c of Object.keys(t.columns)) r[c] = t.columns[c][i]; return r; }

  function count(layer, site) {
    const c = meta.counts.find((x) => x.layer === layer && x.site === site);
    return c ? c.n : 0;
  }
  function missingNote(name, what, otherwise) {
    const why = meta.missing[name] || otherwise || "no rows for this feature";
    return `<p class="missing" data-missing="${esc(name)}">Missing: ${esc(what || "the " + name + " table")} (${esc(why)}).</p>`;
  }
  function present(name) { return meta.present.indexOf(name) >= 0; }

  /* The features of one layer: lookups by (site, feature). */
  function featureIndex(bundle) {
    const f = T(bundle && bundle.features);
    const labels = T(bundle && bundle.feature_labels);
    const byKey = new Map();
    if (f) {
      const site = col(f, "site"), id = col(f, "feature");
      for (let i = 0; i < f.n; i++) byKey.set(site[i] + ":" + id[i], i);
    }
    return {
      table: f, labels,
      row(site, id) { const i = byKey.get(site + ":" + id); return i === undefined ? null : rec(f, i); },
      desc(site, id) { const i = byKey.get(site + ":" + id); return i === undefined ? "" : (val(f, "description", i) || ""); },
    };
  }

  // ------------------------------------------------------------------ links

  function link(path) {
    return "#" + path + (state.site !== meta.input_sites[0] && meta.input_sites.length > 1 ? "?in=" + encodeURIComponent(state.site) : "");
  }
  function outLink(layer, f, fi, n) {
    const d = fi ? fi.desc(OUT, f) : "";
    return `<a class="feat" href="${link(`/out/${layer}/${f}`)}" title="${esc(d)}">out #${f}</a>` +
      (n ? ` <span class="desc">${esc(trunc(d, n))}</span>` : "");
  }
  function inLink(layer, f, fi, n) {
    if (f === null || f === undefined) return "–";
    if (f < 0) return '<span class="const" title="the constant coordinate (the input SAE\'s b_dec)">const</span>';
    const d = fi ? fi.desc(state.site, f) : "";
    return `<a class="feat" href="${link(`/in/${layer}/${f}`)}" title="${esc(d)}">in #${f}</a>` +
      (n ? ` <span class="desc">${esc(trunc(d, n))}</span>` : "");
  }

  // ------------------------------------------------------------------ plots

  const PLOT_CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d"] };
  function plotSlot(id, height) { return `<div class="plot" id="${id}" style="height:${height || 320}px"><span class="note">drawing&hellip;</span></div>`; }
  async function plot(id, data, layout, onClick) {
    const token = state.routeToken;
    const P = await needPlotly();
    const el = document.getElementById(id);
    if (!el || token !== state.routeToken) return;
    if (!P) { el.outerHTML = '<p class="missing">Plots unavailable: plotly.min.js was not shipped with this site.</p>'; return; }
    el.textContent = "";
    const base = { margin: { l: 60, r: 20, t: 30, b: 50 }, font: { size: 12 }, hoverlabel: { align: "left" } };
    await P.newPlot(el, data, Object.assign(base, layout), PLOT_CONFIG);
    if (onClick) el.on("plotly_click", onClick);
  }

  // ------------------------------------------------------------------ header

  function renderHeader() {
    const nav = document.getElementById("nav");
    const layers = meta.layers.map((l) => `<a href="${link("/layer/" + l)}">L${l}</a>`).join(" ");
    nav.innerHTML = `<a href="${link("/")}">Index</a> <span class="layers">Layers: ${layers || "none"}</span>` +
      (meta.report ? ' <a href="../report/index.html">Report</a>' : "") +
      (meta.graphs && meta.graphs.length ? ' <span class="graphs">Graphs: ' + meta.graphs.map((g) =>
        `<a href="${esc(g.viewer)}" title="${esc(g.prompt)} ` +
        `(circuit-tracer's viewer: open the explorer from bilinear-circuits explore --serve or graph --serve)">${esc(g.prompt.slice(0, 24))}</a> ` +
        `(<a href="../graphs/${encodeURIComponent(g.slug)}.json">JSON</a>)`).join(", ") + "</span>" : "");
    const sw = document.getElementById("site-switch");
    if (meta.input_sites.length > 1) {
      sw.innerHTML = "input SAE: <select id=\"input-site\">" + meta.input_sites.map((s) =>
        `<option value="${esc(s)}"${s === state.site ? " selected" : ""}>${esc(s)}</option>`).join("") + "</select>";
      document.getElementById("input-site").onchange = (e) => {
        const h = location.hash.replace(/^#/, "").split("?")[0] || "/";
        location.hash = h + (e.target.value === meta.input_sites[0] ? "" : "?in=" + encodeURIComponent(e.target.value));
      };
    } else sw.innerHTML = meta.input_sites.length ? `input SAE: ${esc(meta.input_sites[0])}` : "";
  }

  function notFound(message) {
    document.title = "Not found";
    main.innerHTML = `<section id="not-found" class="notfound"><h1>Not found</h1><p>${esc(message)}</p>` +
      `<p><a href="${link("/")}">Back to the index</a></p></section>`;
  }

  // ------------------------------------------------------------------ index

  const INDEX_COLUMNS = [
    { key: "layer", label: "layer", num: true },
    { key: "feature", label: "feature", num: true },
    { key: "description", label: "description" },
    { key: "frequency", label: "frequency", num: true, title: "share of held-out tokens where it fires" },
    { key: "corr", label: null, num: true },
    { key: "gate_rank", label: "pair rank", num: true, asc: true,
      title: "circuit_rank of its circuit candidate pair in the layer (split pairs rank last)" },
    { key: "gate_share", label: "pair share", num: true,
      title: "contribution_share of that pair: its cross term's share of the feature's activation" },
    { key: "group_rank", label: "group rank", num: true, asc: true,
      title: "circuit_rank of its best group gate in the layer (split ones rank last)" },
    { key: "group_share", label: "group share", num: true,
      title: "contribution_share of that group gate: the cross terms between its groups" },
    { key: "energy1", label: "top eigen energy", num: true, title: "energy_share of the largest |eigenvalue|" },
  ];
  function indexValue(key, i) {
    const base = T(D.index.features);
    if (key in base.columns) return base.columns[key][i];
    return val(T(D.index.stats[state.site]), key, i);
  }
  function indexMatches() {
    const s = state.index, base = T(D.index.features);
    const desc = col(base, "description") || [], toks = col(base, "top_tokens_text") || [], layers = col(base, "layer");
    const stats = T(D.index.stats[state.site]);
    const corr = col(stats, "corr"), pairRank = col(stats, "gate_rank"), groupRank = col(stats, "group_rank");
    if (!D.index._search) D.index._search = layers.map((_, i) => ((desc[i] || "") + " " + (toks[i] || "")).toLowerCase());
    const terms = s.q.toLowerCase().split(/\s+/).filter(Boolean);
    const minCorr = s.minCorr === "" ? null : parseFloat(s.minCorr);
    const out = [];
    for (let i = 0; i < base.n; i++) {
      if (s.layer !== "all" && layers[i] !== +s.layer) continue;
      if (terms.length && !terms.every((t) => D.index._search[i].indexOf(t) >= 0)) continue;
      if (s.gatesOnly && !((pairRank && isNum(pairRank[i])) || (groupRank && isNum(groupRank[i])))) continue;
      if (isNum(minCorr) && !(corr && isNum(corr[i]) && corr[i] >= minCorr)) continue;
      out.push(i);
    }
    if (s.sort) {
      const key = s.sort, dir = s.desc ? -1 : 1;
      const v = out.map((i) => indexValue(key, i));
      const order = out.map((_, k) => k);
      order.sort((a, b) => {
        const x = v[a], y = v[b];
        const nx = x === null || x === undefined || (typeof x === "number" && !isFinite(x));
        const ny = y === null || y === undefined || (typeof y === "number" && !isFinite(y));
        if (nx || ny) return nx === ny ? a - b : nx ? 1 : -1;
        if (typeof x === "string") return dir * x.localeCompare(y) || a - b;
        return dir * (x - y) || a - b;
      });
      return order.map((k) => out[k]);
    }
    return out;
  }
  function indexBody() {
    const rows = indexMatches(), s = state.index;
    const shown = rows.slice(0, s.limit);
    const html = shown.map((i) => {
      const layer = indexValue("layer", i), f = indexValue("feature", i);
      const d = indexValue("description", i), toks = indexValue("top_tokens_text", i);
      const side = (key) => (indexValue(key, i) || []).map((m) => "in #" + m).join(", ");
      const pairText = side("gate_a") ? `(${side("gate_a")}) AND (${side("gate_b")})` + (indexValue("gate_split", i) ? " (split pair)" : "") : "";
      const groupText = side("group_a") ? `(${side("group_a")}) AND (${side("group_b")})` + (indexValue("group_split", i) ? " (split)" : "") : "";
      return `<tr data-layer="${layer}" data-feature="${f}"><td>${layer}</td>` +
        `<td><a href="${link(`/out/${layer}/${f}`)}">${f}</a></td>` +
        `<td class="text"><a href="${link(`/out/${layer}/${f}`)}">${esc(d) || '<span class="note">no description</span>'}</a>` +
        (toks ? `<div class="toks">${esc(toks)}</div>` : "") + `</td>` +
        `<td>${pctReadable(indexValue("frequency", i))}</td><td>${fmt(indexValue("corr", i))}</td>` +
        `<td title="${esc(pairText)}">${fmt(indexValue("gate_rank", i))}</td><td>${fmt(indexValue("gate_share", i))}</td>` +
        `<td title="${esc(groupText)}">${fmt(indexValue("group_rank", i))}</td><td>${fmt(indexValue("group_share", i))}</td>` +
        `<td>${fmt(indexValue("energy1", i))}</td></tr>`;
    }).join("");
    document.getElementById("index-body").innerHTML = html ||
      '<tr><td colspan="10" class="text note">No feature matches.</td></tr>';
    const total = T(D.index.features).n;
    document.getElementById("index-count").textContent =
      `${shown.length} shown of ${rows.length} matching (${total} output features in all)`;
    const more = document.getElementById("index-more");
    more.style.display = rows.length > shown.length ? "" : "none";
    for (const th of document.querySelectorAll("#index-table th[data-key]")) {
      th.classList.toggle("sorted", th.dataset.key === s.sort);
      th.dataset.dir = th.dataset.key === s.sort ? (s.desc ? "desc" : "asc") : "";
    }
  }
  /* The first page's lead: each layer's best circuit candidates, pairs and group gates, by
   * circuit_rank, with numbers rounded for reading (the layer pages have them all). */
  function rankedCircuits() {
    const base = T(D.index.features), stats = T(D.index.stats[state.site]);
    let html = `<h1 id="ranked">Ranked circuits per layer</h1>`;
    const RANKED_SHOWN = D.index.ranked_shown;  // pipelines.explorer.data.RANKED_SHOWN
    if (!stats || !col(stats, "gate_rank")) {
      return html + missingNote("gate_verdicts", "ranked circuits (the gate_verdicts table: run the verdicts stage)");
    }
    html += `<p class="note">Each layer's best ${RANKED_SHOWN} circuit candidates of each kind by circuit rank: an output
      feature of the output SAE and the two sides that build it (input features of the SAE on <b>${esc(state.site)}</b>).
      <b>type</b>: what removing each side from the MLP input does to the output (exact interventions; the rule is in
      <code>circuits.gates.types</code>); <b>causal</b>: the causal score, which the ranking orders by less its sampling error (<code>circuits.gates.ranking</code>);
      <b>share</b>: the cross terms' share of the output's activation on held-out tokens; <b>both on</b>: how often both
      sides are active where the output is; <b>and_data</b>: the truth table's AND measure (correlational).</p>`;
    const layers = col(base, "layer"), feats = col(base, "feature"), desc = col(base, "description") || [];
    const SIDE_SHOWN = 6;  // members of a group side listed; the layer and feature pages list them all
    const shortDesc = new Map();  // the sides' inputs: short descriptions (pipelines.explorer.data._side_descriptions)
    const sideTable = T(D.index.inputs && D.index.inputs[state.site]);
    if (sideTable) {
      const l = col(sideTable, "layer"), f = col(sideTable, "feature"), d = col(sideTable, "description");
      for (let i = 0; i < sideTable.n; i++) shortDesc.set(l[i] + ":" + f[i], d[i]);
    }
    const sides = (layer, list) => (list || []).slice(0, SIDE_SHOWN).map((m) => m < 0 ? "const" :
      `<a class="feat" href="${link(`/in/${layer}/${m}`)}">in #${m}</a>` +
      (shortDesc.get(layer + ":" + m) ? ` <span class="desc">${esc(shortDesc.get(layer + ":" + m))}</span>` : "")).join(", ") +
      ((list || []).length > SIDE_SHOWN ? ` <span class="note">and ${list.length - SIDE_SHOWN} more</span>` : "");
    const two = (v) => (isNum(v) ? v.toFixed(2) : "–");
    for (const layer of meta.layers) {
      const rows = [];
      for (const [kind, prefix] of [["pair", "gate"], ["group", "group"]]) {
        const ranks = col(stats, prefix + "_rank") || [];
        const mine = layers.map((l, i) => i).filter((i) => layers[i] === layer && isNum(ranks[i]))
          .sort((a, b) => ranks[a] - ranks[b]).slice(0, RANKED_SHOWN);
        for (const i of mine) {
          const f = feats[i];
          rows.push(`<tr data-kind="${kind}"><td class="text">${kind === "pair" ? "pair" : "group gate"}</td><td>${ranks[i]}</td>` +
            `<td class="text"><a class="feat" href="${link(`/out/${layer}/${f}`)}">out #${f}</a> <span class="desc">${esc(trunc(desc[i], 60))}</span></td>` +
            `<td class="text">${sides(layer, val(stats, prefix + "_a", i))}</td><td class="text">${sides(layer, val(stats, prefix + "_b", i))}` +
            `${val(stats, prefix + "_split", i) ? ' <span class="tag no">split</span>' : ""}</td>` +
            `<td class="text">${esc(val(stats, prefix + "_type", i) ?? "–")}</td><td>${two(val(stats, prefix + "_causal", i))}</td>` +
            `<td>${pct(val(stats, prefix + "_share", i))}</td><td>${pct(val(stats, prefix + "_coactivation", i))}</td>` +
            `<td>${two(val(stats, prefix + "_and_data", i))}</td></tr>`);
        }
      }
      html += `<h2 id="ranked-L${layer}">Layer ${layer} <a class="note" href="${link("/layer/" + layer)}">(all its candidates)</a></h2>` +
        (rows.length ? `<table class="data ranked" data-layer="${layer}"><thead><tr><th class="text">kind</th><th>rank</th>` +
          `<th class="text">output</th><th class="text">side a</th><th class="text">side b</th><th class="text">type</th>` +
          `<th>causal</th><th>share</th><th>both on</th>` +
          `<th>and_data</th></tr></thead><tbody>${rows.join("")}</tbody></table>`
          : '<p class="note">Verdicts not run for this layer: no ranked candidates yet.</p>');
    }
    return html;
  }

  function renderIndex() {
    document.title = `Explorer: ${meta.run}`;
    const s = state.index;
    if (!D.index || !D.index.features) { main.innerHTML = '<p class="missing">Missing: data/index.js.</p>'; return; }
    const rank = D.index.corr_rank;
    const heads = INDEX_COLUMNS.map((c) => `<th data-key="${c.key}"${c.num ? "" : ' class="text"'} title="${esc(c.title || "click to sort")}">` +
      `${esc(c.label || `rank-${rank} corr`)}</th>`).join("");
    const missing = ["features", "lowrank", "eigen"].filter((n) => !present(n))  // gate_verdicts: in rankedCircuits
      .map((n) => missingNote(n, `the ${n} table (its columns are empty)`)).join("");
    main.innerHTML = rankedCircuits() + `<h1 id="all-features">All output features</h1>
      <p class="note">Every feature of the output SAE (site ${esc(OUT)}) of every layer. Click a column to sort; the
      search matches descriptions and top tokens (every word must appear). Numbers use the input SAE on
      <b>${esc(state.site)}</b>.</p>${missing}
      <div class="controls">
        <input id="search" type="search" placeholder="search descriptions and tokens" value="${esc(s.q)}">
        <label>layer <select id="layer-filter"><option value="all">all</option>${meta.layers.map((l) =>
          `<option value="${l}"${String(l) === String(s.layer) ? " selected" : ""}>${l}</option>`).join("")}</select></label>
        <label>rank-${rank} corr &ge; <input id="min-corr" type="number" step="0.05" min="-1" max="1" value="${esc(s.minCorr)}"></label>
        <label><input id="gates-only" type="checkbox"${s.gatesOnly ? " checked" : ""}> with a ranked circuit candidate</label>
        <span id="index-count" class="note"></span>
      </div>
      <table id="index-table" class="data wide"><thead><tr>${heads}</tr></thead><tbody id="index-body"></tbody></table>
      <p><button id="index-more">show 200 more</button> <button id="index-all">show all</button></p>`;
    const update = () => { s.limit = 200; indexBody(); };
    document.getElementById("search").oninput = (e) => { s.q = e.target.value; update(); };
    document.getElementById("layer-filter").onchange = (e) => { s.layer = e.target.value; update(); };
    document.getElementById("min-corr").oninput = (e) => { s.minCorr = e.target.value; update(); };
    document.getElementById("gates-only").onchange = (e) => { s.gatesOnly = e.target.checked; update(); };
    document.getElementById("index-more").onclick = () => { s.limit += 200; indexBody(); };
    document.getElementById("index-all").onclick = () => { s.limit = Infinity; indexBody(); };
    for (const th of document.querySelectorAll("#index-table th[data-key]")) {
      th.onclick = () => {
        const key = th.dataset.key;
        if (s.sort === key) s.desc = !s.desc;
        else { const c = INDEX_COLUMNS.find((x) => x.key === key); s.sort = key; s.desc = c.num && !c.asc && key !== "layer" && key !== "feature"; }
        indexBody();
      };
    }
    indexBody();
  }

  // ------------------------------------------------------------------ feature sections shared by both pages

  function featureHead(fi, layer, site, f) {
    const r = fi.row(site, f);
    if (!fi.table) return { html: missingNote("features", "the features table: no description, contexts or tokens"), row: null };
    if (!r) return { html: `<p class="missing" data-missing="features">Missing: no row of the features table for this feature.</p>`, row: null };
    const facts = [
      ["frequency", fmt(r.frequency)], ["max activation", fmt(r.max_activation)], ["mean activation", fmt(r.mean_activation)],
      ["top token", r.top_token === null || r.top_token === undefined ? "–" : `<code>${esc(r.top_token)}</code> (${pct(r.top_token_share)}${r.is_token_feature ? ", token feature" : ""})`],
    ];
    if (r.label) facts.push(["label", `${esc(r.label)} (${pct(r.label_share)})`]);
    if (r.boost_label) facts.push(["boosts", `${esc(r.boost_label)} words (${fmt(r.boost_sd)} sd)`]);
    let html = `<p class="description" id="description">${esc(r.description) || '<span class="note">no description</span>'}</p>` +
      `<p class="facts">${facts.map(([k, v]) => `<span class="fact"><span class="k">${esc(k)}</span> ${v}</span>`).join("")}</p>`;
    const tops = r.top_contexts || [], samples = r.sample_contexts || [], qs = r.sample_quantiles || [];
    html += `<div class="cols"><section><h3>Top contexts</h3>` + (tops.length ? `<ol class="contexts">${tops.map((c) => `<li>${context(c)}</li>`).join("")}</ol>` : '<p class="note">none</p>') +
      `</section><section><h3>Contexts at quantiles of its activation</h3>` +
      (samples.length ? `<ul class="contexts">${samples.map((c, i) => `<li><span class="q">${isNum(qs[i]) ? "q" + qs[i].toFixed(2) : ""}</span> ${context(c)}</li>`).join("")}</ul>` : '<p class="note">none</p>') +
      `</section></div>`;
    if (site === OUT) {
      const chips = (xs, cls) => (xs && xs.length ? xs.map((t) => `<span class="chip ${cls}">${esc(t)}</span>`).join(" ") : '<span class="note">none</span>');
      html += `<div class="logits"><div><b>Boosted tokens</b> ${chips(r.boosted_tokens, "up")}</div>` +
        `<div><b>Suppressed tokens</b> ${chips(r.suppressed_tokens, "down")}</div></div>`;
    }
    return { html, row: r };
  }

  function labelSection(fi, site, f) {
    const t = fi.labels;
    if (!t) return `<h2>Label shares</h2>` + missingNote("feature_labels");
    const rows = rowsOf(t, "feature", f).filter((i) => val(t, "site", i) === site).map((i) => rec(t, i));
    if (!rows.length) return `<h2>Label shares</h2><p class="note">No labels for this feature.</p>`;
    const shares = rows.filter((r) => r.kind === "activation_share"), boosts = rows.filter((r) => r.kind === "logit_boost");
    const channels = [...new Set(shares.map((r) => r.channel))];
    let html = `<h2>Label shares</h2><div class="labels">` + channels.map((ch) =>
      `<div class="channel"><h4>${esc(ch)}</h4>` + shares.filter((r) => r.channel === ch).sort((a, b) => (b.value || 0) - (a.value || 0)).map((r) =>
        `<div class="bar"><span class="name">${esc(r.class)}</span><span class="track"><span style="width:${Math.max(0, Math.min(100, 100 * (r.value || 0))).toFixed(1)}%"></span></span><span class="v">${pct(r.value)}</span></div>`).join("") +
      `</div>`).join("") + `</div>`;
    if (boosts.length) {
      html += `<p>Logit boost of lexicon classes (sd): ` + boosts.map((r) => `${esc(r.class)} <b>${fmt(r.value)}</b>` +
        (isNum(r.n_tokens) ? ` <span class="note">(${fmt(r.n_tokens)} tokens)</span>` : "")).join(", ") + `</p>`;
    }
    return html;
  }

  function tableHtml(headers, rows, cls) {
    return `<table class="data ${cls || ""}"><thead><tr>${headers.map((h) => `<th${h.startsWith("!") ? ' class="text"' : ""}>${esc(h.replace(/^!/, ""))}</th>`).join("")}</tr></thead>` +
      `<tbody>${rows.map((r) => `<tr>${r.map((c, k) => `<td${headers[k].startsWith("!") ? ' class="text"' : ""}>${c}</td>`).join("")}</tr>`).join("")}</tbody></table>`;
  }

  // ------------------------------------------------------------------ output feature page

  function interactionsSection(C, layer, f, fi, jobs) {
    const it = T(C && C.interactions);
    if (!it) return `<h2 id="interactions">Interactions</h2>` + missingNote("interactions");
    const rows = rowsOf(it, "out_feature", f).map((i) => rec(it, i));
    if (!rows.length) return `<h2 id="interactions">Interactions</h2><p class="note">No interactions stored for this feature.</p>`;
    const kind = (k) => rows.filter((r) => r.kind === k).sort((a, b) => a.rank - b.rank);
    const cross = kind("cross"), self = kind("self"), linear = kind("linear"), constant = kind("constant");
    // the inputs of the strongest cross and self terms, by |coefficient|
    const top = cross.slice(0, HEATMAP_PAIRS).concat(self.slice(0, HEATMAP_PAIRS))
      .sort((a, b) => Math.abs(b.coefficient) - Math.abs(a.coefficient));
    const inputs = [];
    for (const r of top) for (const x of [r.in_a, r.in_b]) if (x >= 0 && inputs.indexOf(x) < 0 && inputs.length < 24) inputs.push(x);
    const pos = new Map(inputs.map((x, k) => [x, k]));
    const n = inputs.length;
    const z = [...Array(n)].map(() => Array(n).fill(null));
    const text = [...Array(n)].map(() => Array(n).fill(""));
    const ids = [...Array(n)].map(() => Array(n).fill(null));
    const label = (x) => `in #${x} ${esc(trunc(fi.desc(state.site, x), 50))}`;
    for (const r of cross.concat(self)) {
      if (!pos.has(r.in_a) || !pos.has(r.in_b)) continue;
      const a = pos.get(r.in_a), b = pos.get(r.in_b);
      const t = `${esc(r.kind)} rank ${fmt(r.rank)}: coefficient <b>${fmt(r.coefficient)}</b><br>${label(r.in_a)}` + (r.kind === "cross" ? `<br>${label(r.in_b)}` : "");
      for (const [y, x] of [[a, b], [b, a]]) { z[y][x] = r.coefficient; text[y][x] = t; ids[y][x] = [r.in_a, r.in_b, r.kind, r.coefficient]; }
    }
    const zmax = Math.max(1e-12, ...z.flat().filter(isNum).map(Math.abs));
    const names = inputs.map((x) => "#" + x);
    jobs.push(() => plot("heatmap", [{
      type: "heatmap", z, x: names, y: names, text, customdata: ids, hovertemplate: "%{text}<extra></extra>",
      colorscale: DIVERGING, zmin: -zmax, zmax, zmid: 0, hoverongaps: false, xgap: 1, ygap: 1,
      colorbar: { title: { text: "coef." } },
    }], { xaxis: { type: "category", title: { text: "input feature" }, tickangle: -60 },
          yaxis: { type: "category", autorange: "reversed" }, margin: { l: 60, r: 20, t: 20, b: 70 } }, (ev) => {
      const p = ev.points && ev.points[0];
      const d = p && p.customdata;
      const out = document.getElementById("heatmap-pick");
      if (!d || !out) return;
      out.innerHTML = `${esc(d[2])} term of ${inLink(layer, d[0], fi, 40)}` + (d[2] === "cross" ? ` &times; ${inLink(layer, d[1], fi, 40)}` : "") +
        `: coefficient <b>${fmt(d[3])}</b>`;
    }));
    if (linear.length) {
      const lin = linear.slice(0, 20);
      jobs.push(() => plot("linear-bars", [{
        type: "bar", x: lin.map((r) => "#" + r.in_a), y: lin.map((r) => r.coefficient), customdata: lin.map((r) => r.in_a),
        hovertext: lin.map((r) => label(r.in_a)), hovertemplate: "%{hovertext}<br>linear coefficient <b>%{y:.4g}</b><extra></extra>",
        marker: { color: lin.map((r) => (r.coefficient >= 0 ? "#c0392b" : "#2166ac")) },
      }], { xaxis: { type: "category", tickangle: -60 }, yaxis: { title: { text: "coefficient" } }, margin: { l: 60, r: 10, t: 10, b: 60 } },
      (ev) => { const p = ev.points && ev.points[0]; if (p) location.hash = link(`/in/${layer}/${p.customdata}`); }));
    }
    const table = (list, pair) => tableHtml(pair ? ["rank", "!input a", "!input b", "coefficient"] : ["rank", "!input", "coefficient"],
      list.map((r) => pair ? [fmt(r.rank), inLink(layer, r.in_a, fi, 45), inLink(layer, r.in_b, fi, 45), fmt(r.coefficient)]
                           : [fmt(r.rank), inLink(layer, r.in_a, fi, 60), fmt(r.coefficient)]), "interactions");
    const c = constant.length ? fmt(constant[0].coefficient) : "–";
    return `<h2 id="interactions">Interactions</h2>
      <p class="note">The feature's pre-activation as a quadratic form of the input SAE's latents: a cross term
      (a, b) adds coefficient &times; z<sub>a</sub> z<sub>b</sub>, a self term coefficient &times; z<sub>a</sub><sup>2</sup>, a linear
      term coefficient &times; z<sub>a</sub> (through the input SAE's b_dec). The heatmap shows the strongest ${HEATMAP_PAIRS}
      cross and ${HEATMAP_PAIRS} self terms over the inputs involved (self terms on the diagonal; blank: not among the
      stored top terms). Hover a cell for the pair, click it for links; drag to zoom.</p>
      <div class="cols"><div class="grow">${n ? plotSlot("heatmap", Math.max(360, 24 * n + 120)) : '<p class="note">No cross or self terms.</p>'}
      <p id="heatmap-pick" class="pick note">Click a cell to see its inputs.</p></div>
      <div class="side"><h3>Linear terms</h3>${linear.length ? plotSlot("linear-bars", 260) : '<p class="note">none</p>'}
      <p>Constant term: <b>${c}</b></p></div></div>
      <div class="cols three">
      <details open><summary>Cross terms (${cross.length})</summary><div class="scroll">${table(cross, true)}</div></details>
      <details open><summary>Self terms (${self.length})</summary><div class="scroll">${table(self, false)}</div></details>
      <details open><summary>Linear terms (${linear.length})</summary><div class="scroll">${table(linear, false)}</div></details></div>`;
  }

  function eigenSection(C, layer, f, fi, jobs) {
    let html = `<h2 id="eigen">Eigen-spectrum</h2>`;
    const e = T(C && C.eigen);
    if (!e) html += missingNote("eigen");
    else {
      const rows = rowsOf(e, "out_feature", f).map((i) => rec(e, i)).sort((a, b) => a.rank - b.rank);
      if (!rows.length) html += '<p class="note">No eigenvalues stored for this feature.</p>';
      else {
        html += `<p class="note">Eigenvalues of Q<sub>u</sub> by |eigenvalue|; energy share: &lambda;<sup>2</sup> over the sum of all
          &lambda;<sup>2</sup>; activation share: the eigenvector's part of the activation over the active tokens.</p>` + plotSlot("spectrum", 280) +
          `<details><summary>Table (${rows.length} eigenvalues)</summary><div class="scroll">` +
          tableHtml(["rank", "eigenvalue", "energy share", "activation share"], rows.map((r) => [fmt(r.rank), fmt(r.eigenvalue), fmt(r.energy_share), fmt(r.activation_share)]), "eigen") +
          `</div></details>`;
        jobs.push(() => plot("spectrum", [{
          type: "bar", x: rows.map((r) => r.rank), y: rows.map((r) => r.eigenvalue),
          customdata: rows.map((r) => [fmt(r.energy_share), fmt(r.activation_share)]),
          hovertemplate: "rank %{x}: &lambda; = <b>%{y:.4g}</b><br>energy share %{customdata[0]}<br>activation share %{customdata[1]}<extra></extra>",
          marker: { color: rows.map((r) => (r.eigenvalue >= 0 ? "#c0392b" : "#2166ac")) },
        }], { xaxis: { title: { text: "rank" } }, yaxis: { title: { text: "eigenvalue" } }, margin: { l: 60, r: 10, t: 10, b: 45 } }));
      }
    }
    const ei = T(C && C.eigen_inputs);
    html += `<h3>What the top eigenvectors read</h3>`;
    if (!ei) return html + missingNote("eigen_inputs");
    const rows = rowsOf(ei, "out_feature", f).map((i) => rec(ei, i));
    if (!rows.length) return html + '<p class="note">No eigenvector inputs stored for this feature.</p>';
    const eig = new Map();
    if (e) for (const i of rowsOf(e, "out_feature", f)) eig.set(val(e, "rank", i), val(e, "eigenvalue", i));
    const ranks = [...new Set(rows.map((r) => r.eigen_rank))].sort((a, b) => a - b);
    html += `<p class="note">Per eigenvector, the input features whose (normalised) MLP-input directions it aligns with most, by |cosine|.</p><div class="eigvecs">` + ranks.map((k) => {
      const list = rows.filter((r) => r.eigen_rank === k).sort((a, b) => a.input_rank - b.input_rank);
      return `<div class="eigvec"><h4>v${fmt(k)}${eig.has(k) ? ` (&lambda; ${fmt(eig.get(k))})` : ""}</h4>` +
        tableHtml(["!input", "cosine"], list.map((r) => [inLink(layer, r.in_feature, fi, 28), fmt(r.cosine)]), "compact") + `</div>`;
    }).join("") + `</div>`;
    return html;
  }

  function lowrankSection(C, layer, f, jobs) {
    let html = `<h2 id="lowrank">Low-rank approximations</h2>`;
    const t = T(C && C.lowrank);
    if (!t) return html + missingNote("lowrank");
    const rows = rowsOf(t, "out_feature", f).map((i) => rec(t, i)).sort((a, b) => a.n_eigs - b.n_eigs);
    if (!rows.length) return html + '<p class="note">No low-rank correlations stored for this feature.</p>';
    html += `<p class="note">Pearson correlation, over the ${fmt(rows[0].n_active)} held-out tokens where the feature is active, of its
      activation with the approximation keeping the r largest eigenpairs (null: too few tokens).</p>` +
      `<div class="cols"><div class="grow">${plotSlot("lowrank-plot", 260)}</div><div class="side">` +
      tableHtml(["r", "correlation"], rows.map((r) => [fmt(r.n_eigs), fmt(r.corr_active)]), "compact lowrank") + `</div></div>`;
    jobs.push(() => plot("lowrank-plot", [{ type: "scatter", mode: "lines+markers", x: rows.map((r) => r.n_eigs), y: rows.map((r) => r.corr_active),
      hovertemplate: "r = %{x}: correlation <b>%{y:.4g}</b><extra></extra>" }],
      { xaxis: { title: { text: "eigenpairs kept (r)" }, dtick: 1 }, yaxis: { title: { text: "active-only correlation" }, range: [-0.05, 1.05] },
        margin: { l: 60, r: 10, t: 10, b: 45 } }));
    html += `<h3>Activation against its approximations</h3><div id="samples-box">${plotSlot("samples-plot", 320)}</div>`;
    const token = state.routeToken;
    jobs.push(async () => {
      const S = await needSite("samples", layer);
      const box = document.getElementById("samples-box");
      if (!box || token !== state.routeToken) return;
      const st = T(S && S.lowrank_samples);
      if (!st) { box.innerHTML = missingNote("lowrank_samples", "the lowrank_samples table: no per-token scatter"); return; }
      const samples = rowsOf(st, "out_feature", f).map((i) => rec(st, i));
      if (!samples.length) { box.innerHTML = '<p class="note">No sampled tokens for this feature.</p>'; return; }
      const ranks = [...new Set(samples.map((r) => r.n_eigs))].sort((a, b) => a - b);
      const withOffset = samples.every((r) => isNum(r.offset));
      const y = (r) => r.approx + (withOffset ? r.offset : 0);
      const acts = samples.map((r) => r.activation);
      const lo = Math.min(...acts), hi = Math.max(...acts);
      const colours = ["#4a78a8", "#e08a2c", "#3a9a5b"];
      const traces = ranks.map((rank, k) => {
        const mine = samples.filter((r) => r.n_eigs === rank);
        return { type: "scatter", mode: "markers", name: `r = ${fmt(rank)}`, x: mine.map((r) => r.activation), y: mine.map(y),
          marker: { size: 6, opacity: 0.7, color: colours[k % colours.length] },
          hovertemplate: `r = ${fmt(rank)}: activation %{x:.4g}, approximation %{y:.4g}<extra></extra>` };
      });
      if (withOffset) traces.push({ type: "scatter", mode: "lines", name: "full rank (exact)", x: [lo, hi], y: [lo, hi],
        line: { color: "#888", dash: "dot" }, hoverinfo: "skip" });
      box.insertAdjacentHTML("afterbegin", `<p class="note">${samples.length / ranks.length} of its active held-out tokens, drawn at random. ` +
        (withOffset ? "The approximation includes the output's constant offset, so at full rank every point lies on the dotted diagonal (an exact identity)."
          : "These outputs have no constant offset stored: the approximation is the quadratic form alone.") + `</p>`);
      await plot("samples-plot", traces, { xaxis: { title: { text: "activation" } }, yaxis: { title: { text: "rank-r approximation" } },
        legend: { orientation: "h", y: 1.12 }, margin: { l: 60, r: 10, t: 30, b: 45 } });
    });
    return html;
  }

  /* The verdicts stage's row of output f: its circuit candidate pair (the best ranked of its
     rows: split pairs that outscore it are ranked after it), or its best group gate. */
  function verdictOf(V, f, kind) {
    const v = T(V && V.gate_verdicts);
    if (!v) return null;
    let best = null;
    for (const i of rowsOf(v, "out_feature", f))
      if (val(v, "kind", i) === kind && (best === null || val(v, "circuit_rank", i) < val(v, "circuit_rank", best))) best = i;
    return best === null ? null : rec(v, best);
  }
  /* The corpus's gate tags (meta.gate_tags: the negation gate of the built-in stories) that mark a verdict row. */
  function gateTags(v) { return (meta.gate_tags || []).filter((tag) => v[tag.column] === true); }
  function verdictHtml(v) {
    if (!v) return "";
    const tags = (v.is_and ? '<span class="tag yes">AND gate</span>' : '<span class="tag no">not shown to be an AND</span>') +
      (v.split_pair ? ' <span class="tag no">split pair</span>' : "") +
      gateTags(v).map((tag) => ` <span class="tag yes">${esc(tag.name)}</span>`).join("");
    const labels = v.label_a || v.label_b ? ` <span class="note">Labels: side a ${esc(v.label_a || "none")}, side b ${esc(v.label_b || "none")}.</span>` : "";
    const drops = [["a", v.drop_a], ["b", v.drop_b], ["both", v.drop_both]].filter(([, d]) => isNum(d));
    const removed = drops.length ? `<p class="note drops">Removing ${drops.map(([k, d]) => `${k} removes ${pct(d)}`).join(", ")} of the output's
      activation (over ${fmt(v.ablation_tokens)} tokens).` + (isNum(v.share_a) ? ` The output's quadratic form there: side a ${pct(v.share_a)},
      side b ${pct(v.share_b)}, other inputs ${pct(v.share_other)}, b_dec ${pct(v.share_bias)}, SAE error ${pct(v.share_error)}.` : "") + `</p>` : "";
    return `<p class="verdict">${tags} circuit rank ${fmt(v.circuit_rank)}: <span class="verdict-text">${esc(v.verdict)}</span>${labels}</p>` +
      `<p class="note truth-text">Truth table: ${esc(v.truth)} (${fmt(v.both_tokens)} tokens with both sides on, ${fmt(v.apart_tokens)} with one alone);
      contribution share ${fmt(v.contribution_share)}, coactivation ${fmt(v.coactivation)}, and_data ${fmt(v.and_data)}, gate_score ${fmt(v.gate_score)}.</p>` + removed;
  }
  function truthHtml(cells, table) {
    if (!cells) return `<div>${missingNote(table, "the truth table (the " + table + " table)")}</div>`;
    if (!cells.length) {
      return `<div><p class="note no-truth">No truth table` + (table === "gate_truth" ? `: the circuits stage tabulates each layer's best
        data-ranked pairs (the gates table's layer rank) only, and this candidate is not one of them` : "") + `.</p></div>`;
    }
    const cell = (name) => {
      const c = cells.find((x) => x.cell === name);
      return c ? `<b>${fmt(c.mean_activation)}</b><br><span class="note">active ${pct(c.active_share)}, ${fmt(c.n_tokens)} tokens` +
        (isNum(c.quantile_activation) ? `, q ${fmt(c.quantile_activation)}` : "") + `</span>` : "–";
    };
    return `<div><h4>Truth table</h4><table class="data truth"><thead><tr><th></th><th>b on</th><th>b off</th></tr></thead><tbody>` +
      `<tr><th>a on</th><td>${cell("on_on")}</td><td>${cell("on_off")}</td></tr>` +
      `<tr><th>a off</th><td>${cell("off_on")}</td><td>${cell("off_off")}</td></tr></tbody></table>` +
      `<p class="note">Mean activation of the output over the tokens of each cell.</p></div>`;
  }
  function ablationHtml(ab, table) {
    if (!ab) return `<div>${missingNote(table, "the ablations (the " + table + " table)")}</div>`;
    if (!ab.length) return `<div><p class="note">No ablation measured: only each layer's best candidates are ablated.</p></div>`;
    return `<div><h4>Ablations</h4>` + tableHtml(["!removed", "tokens", "activation before", "after", "pre-act. change", "predicted", "log-prob change"],
      ab.map((x) => [esc(x.ablated), fmt(x.n_tokens), fmt(x.activation_before), fmt(x.activation_after),
        isNum(x.pre_after) && isNum(x.pre_before) ? fmt(x.pre_after - x.pre_before) : "–", fmt(x.pre_change_predicted),
        isNum(x.logprob_after) && isNum(x.logprob_before) ? fmt(x.logprob_after - x.logprob_before) : "–"]), "ablation") +
      `<p class="note">On a seeded sample of held-out tokens where both sides are on and the output is active; log-prob of the feature's boosted tokens.</p></div>`;
  }
  function members(layer, list, fi) { return (list || []).map((m) => inLink(layer, m, fi, 0)).join(", "); }

  /* The card of output f's circuit candidate of one kind (pair or group): the verdicts stage's
   * row, its truth table and its ablations. */
  function candidateCard(C, V, layer, f, fi, kind) {
    const missing = missingNote("gate_verdicts", "verdicts (the gate_verdicts table: run the verdicts stage)");
    if (!T(V && V.gate_verdicts)) return missing;
    const v = verdictOf(V, f, kind);
    if (!v) {
      return kind === "pair" ? '<p class="note">No circuit candidate pair: no pair was seen both together and apart on enough tokens.</p>'
        : '<p class="note">No ranked group gate: none was seen both together and apart on enough tokens.</p>';
    }
    const side = (label, list) => (label ? esc(label) + ": " : "") + (kind === "pair" ? inLink(layer, list[0], fi, 40) : members(layer, list, fi));
    const keys = kind === "pair" ? ["in_a", "in_b"] : ["group_a", "group_b"];
    const tables = kind === "pair" ? ["gate_truth", "gate_ablation"] : ["group_truth", "group_ablation"];
    const mine = (name) => {
      const t = T(C && C[name]);
      return t ? rowsOf(t, "out_feature", f).map((i) => rec(t, i)).filter((r) => r[keys[0]] === v[keys[0]] && r[keys[1]] === v[keys[1]]) : null;
    };
    const title = kind === "pair" ? `Circuit candidate: ${side(v.label_a, [v.in_a])} AND ${side(v.label_b, [v.in_b])}`
      : `Best group gate: (${side(v.label_a, v.members_a)}) AND (${side(v.label_b, v.members_b)})`;
    return `<div class="card gate-card" id="${kind}-card"><h3>${title}</h3>` + verdictHtml(v) +
      `<div class="cols">${truthHtml(mine(tables[0]), tables[0])}${ablationHtml(mine(tables[1]), tables[1])}</div></div>`;
  }

  function gatesSection(C, V, layer, f, fi) {
    let html = `<h2 id="gates">Gate candidates</h2>`;
    const g = T(C && C.gates);
    const rows = g ? rowsOf(g, "out_feature", f).map((i) => rec(g, i)).sort((a, b) =>
      (a.data_rank === null) - (b.data_rank === null) || (a.data_rank || 0) - (b.data_rank || 0) || a.weight_rank - b.weight_rank) : [];
    if (!g) html += missingNote("gates");
    else if (!rows.length) html += '<p class="note">No gate candidates stored for this feature.</p>';
    else {
      html += `<p class="note">Input pairs by what they contribute on held-out tokens (data rank; contribution share: the cross
        term's share of the feature's activation), with the weight-only scores (and_score = cross &minus; |self_a| &minus; |self_b|) and
        how much the two inputs are one concept (the cosine of their MLP-input directions, the lift of their co-activation).
        Over ${fmt(rows[0].n_active)} active tokens.</p>`;
      const line = (r) => [inLink(layer, r.in_a, fi, 30), inLink(layer, r.in_b, fi, 30), fmt(r.data_rank), fmt(r.contribution_share),
        fmt(r.coactivation), fmt(r.and_data), fmt(r.input_cosine), fmt(r.coactivation_lift), fmt(r.weight_rank), fmt(r.and_score), fmt(r.layer_rank)];
      const headers = ["!input a", "!input b", "data rank", "contribution share", "coactivation", "and_data", "input cosine", "lift",
        "weight rank", "and_score", "layer rank"];
      html += tableHtml(headers, rows.slice(0, 10).map(line), "gates");
      if (rows.length > 10) html += `<details><summary>all ${rows.length} candidates</summary>${tableHtml(headers, rows.slice(10).map(line), "gates")}</details>`;
    }
    return html + candidateCard(C, V, layer, f, fi, "pair");
  }

  function groupsSection(C, V, layer, f, fi) {
    let html = `<h2 id="groups">Group gates</h2>`;
    const g = T(C && C.group_gates);
    const rows = g ? rowsOf(g, "out_feature", f).map((i) => rec(g, i)).sort((a, b) =>
      (b.gate_score ?? -Infinity) - (a.gate_score ?? -Infinity) || a.group_a - b.group_a) : [];
    if (!g) html += missingNote("group_gates", "group gates (the group_gates table: run the verdicts stage)");
    else if (!rows.length) html += '<p class="note">No group gate stored for this feature.</p>';
    else {
      html += `<p class="note">ANDs between two groups of inputs: the best split of what one of its eigenvectors reads (source eigen), or
        two label classes (source labels). A group is on where any member is active; the contribution share is that of the cross terms
        between the groups.</p>`;
      html += tableHtml(["!source", "!group a", "!group b", "contribution share", "coactivation", "and_data", "gate_score", "split", "circuit rank"],
        rows.map((r) => [esc(r.source) + (isNum(r.eigen_rank) ? " v" + fmt(r.eigen_rank) : ""),
          (r.label_a ? esc(r.label_a) + ": " : "") + members(layer, r.members_a, fi), (r.label_b ? esc(r.label_b) + ": " : "") + members(layer, r.members_b, fi),
          fmt(r.contribution_share), fmt(r.coactivation), fmt(r.and_data), fmt(r.gate_score), r.split_pair ? "yes" : "", fmt(r.circuit_rank)]), "group-gates");
    }
    return html + candidateCard(C, V, layer, f, fi, "group");
  }

  function pager(kind, layer, f, n) {
    const prev = f > 0 ? `<a href="${link(`/${kind}/${layer}/${f - 1}`)}">&larr; #${f - 1}</a>` : "";
    const next = f + 1 < n ? `<a href="${link(`/${kind}/${layer}/${f + 1}`)}">#${f + 1} &rarr;</a>` : "";
    return `<span class="pager">${prev} <a href="${link(`/layer/${layer}`)}">layer ${layer}</a> ${next}</span>`;
  }

  async function renderOutput(layer, f) {
    const n = count(layer, OUT);
    if (meta.layers.indexOf(layer) < 0 || !(f >= 0 && f < n)) {
      return notFound(meta.layers.indexOf(layer) < 0 ? `This run has no layer ${isNaN(layer) ? "of that name" : layer}.`
        : `Layer ${layer} has no output feature ${isNaN(f) ? "of that id" : f} (its output SAE has ${n} features: 0 to ${n - 1}).`);
    }
    const [F, C, V] = await Promise.all([need(`features_L${layer}`), needSite("circuits", layer), needSite("verdicts", layer)]);
    const fi = featureIndex(F);
    const head = featureHead(fi, layer, OUT, f);
    document.title = `L${layer} out #${f}: ${head.row ? head.row.description || "" : ""}`;
    const jobs = [];
    const sections = [
      interactionsSection(C, layer, f, fi, jobs), eigenSection(C, layer, f, fi, jobs), lowrankSection(C, layer, f, jobs),
      gatesSection(C || {}, V, layer, f, fi), groupsSection(C || {}, V, layer, f, fi),
    ];
    main.innerHTML = `<div class="page-head"><h1>Layer ${layer} &middot; output feature #${f}</h1>${pager("out", layer, f, n)}</div>
      <p class="note">Site ${esc(OUT)}; circuits read through the input SAE on <b>${esc(state.site)}</b>. Jump to:
      <a href="#interactions" data-jump>interactions</a> &middot; <a href="#eigen" data-jump>spectrum</a> &middot;
      <a href="#lowrank" data-jump>low rank</a> &middot; <a href="#gates" data-jump>gates</a> &middot; <a href="#groups" data-jump>group gates</a></p>
      <section id="feature" data-layer="${layer}" data-feature="${f}">${head.html}${labelSection(fi, OUT, f)}</section>
      ${sections.join("")}`;
    jumpLinks();
    contentDone();
    await Promise.all(jobs.map((j) => j()));
  }

  /* In-page anchors would change the route: scroll instead. */
  function jumpLinks() {
    for (const a of main.querySelectorAll("a[data-jump]")) {
      a.onclick = (e) => { e.preventDefault(); const el = document.getElementById(a.getAttribute("href").slice(1)); if (el) el.scrollIntoView(); };
    }
  }

  // ------------------------------------------------------------------ input feature page

  async function renderInput(layer, f) {
    const site = state.site, n = count(layer, site);
    if (meta.layers.indexOf(layer) < 0 || !(f >= 0 && f < n)) {
      return notFound(meta.layers.indexOf(layer) < 0 ? `This run has no layer ${isNaN(layer) ? "of that name" : layer}.`
        : `Layer ${layer} has no input feature ${isNaN(f) ? "of that id" : f} on ${site} (its input SAE has ${n} features: 0 to ${n - 1}).`);
    }
    const [F, C] = await Promise.all([need(`features_L${layer}`), needSite("circuits", layer)]);
    const fi = featureIndex(F);
    const head = featureHead(fi, layer, site, f);
    document.title = `L${layer} in #${f}: ${head.row ? head.row.description || "" : ""}`;
    let builds = `<h2>Output features it helps build</h2>`;
    const it = T(C && C.interactions);
    if (!it) builds += missingNote("interactions");
    else {
      const idx = [...new Set(rowsOf(it, "in_a", f).concat(rowsOf(it, "in_b", f)))];
      const rows = idx.map((i) => rec(it, i)).filter((r) => r.kind !== "constant")
        .sort((a, b) => Math.abs(b.coefficient) - Math.abs(a.coefficient));
      builds += `<p class="note">Its terms among each output feature's stored top interactions, by |coefficient| (${rows.length} in all).</p>`;
      builds += rows.length ? `<div class="scroll tall">` + tableHtml(["!output feature", "kind", "!partner", "coefficient", "rank"], rows.slice(0, 100).map((r) =>
        [outLink(layer, r.out_feature, fi, 50), esc(r.kind), r.kind === "cross" ? inLink(layer, r.in_a === f ? r.in_b : r.in_a, fi, 30) : "–",
          fmt(r.coefficient), fmt(r.rank)]), "builds") + `</div>` : '<p class="note">It appears in no stored interaction.</p>';
    }
    let reads = `<h2>Eigenvectors that read it</h2>`;
    const ei = T(C && C.eigen_inputs);
    if (!ei) reads += missingNote("eigen_inputs");
    else {
      const rows = rowsOf(ei, "in_feature", f).map((i) => rec(ei, i)).sort((a, b) => Math.abs(b.cosine) - Math.abs(a.cosine));
      reads += rows.length ? `<div class="scroll">` + tableHtml(["!output feature", "eigenvector", "cosine"], rows.slice(0, 50).map((r) =>
        [outLink(layer, r.out_feature, fi, 50), "v" + fmt(r.eigen_rank), fmt(r.cosine)]), "reads") + `</div>` : '<p class="note">No stored eigenvector reads it.</p>';
    }
    let gates = `<h2>Gate candidates with it</h2>`;
    const g = T(C && C.gates);
    if (!g) gates += missingNote("gates");
    else {
      const idx = [...new Set(rowsOf(g, "in_a", f).concat(rowsOf(g, "in_b", f)))];
      const rows = idx.map((i) => rec(g, i)).sort((a, b) =>
        (b.contribution_share ?? -Infinity) - (a.contribution_share ?? -Infinity) || b.and_score - a.and_score);
      gates += rows.length ? `<div class="scroll">` + tableHtml(["!output feature", "!partner", "contribution share", "and_score", "data rank", "layer rank"],
        rows.slice(0, 50).map((r) => [outLink(layer, r.out_feature, fi, 40), inLink(layer, r.in_a === f ? r.in_b : r.in_a, fi, 30),
          fmt(r.contribution_share), fmt(r.and_score), fmt(r.data_rank), fmt(r.layer_rank)]), "in-gates") + `</div>` : '<p class="note">In no stored gate candidate.</p>';
    }
    let groups = `<h2>Group gates with it</h2>`;
    const gg = T(C && C.group_gates);
    if (!gg) groups += missingNote("group_gates", "group gates (the group_gates table: run the verdicts stage)");
    else {
      const rows = [];
      const ma = col(gg, "members_a") || [], mb = col(gg, "members_b") || [];
      for (let i = 0; i < gg.n; i++) {
        const side = (ma[i] || []).indexOf(f) >= 0 ? "a" : (mb[i] || []).indexOf(f) >= 0 ? "b" : null;
        if (side) rows.push(Object.assign(rec(gg, i), { side }));
      }
      rows.sort((a, b) => (isNum(a.circuit_rank) ? a.circuit_rank : Infinity) - (isNum(b.circuit_rank) ? b.circuit_rank : Infinity) ||
        (b.gate_score ?? -Infinity) - (a.gate_score ?? -Infinity));
      groups += rows.length ? `<div class="scroll">` + tableHtml(["!output feature", "side", "!its group", "!other group", "contribution share", "gate_score", "circuit rank"],
        rows.slice(0, 50).map((r) => {
          const [own, other, la, lb] = r.side === "a" ? [r.members_a, r.members_b, r.label_a, r.label_b] : [r.members_b, r.members_a, r.label_b, r.label_a];
          return [outLink(layer, r.out_feature, fi, 40), r.side, (la ? esc(la) + ": " : "") + members(layer, own, fi),
            (lb ? esc(lb) + ": " : "") + members(layer, other, fi), fmt(r.contribution_share), fmt(r.gate_score), fmt(r.circuit_rank)];
        }), "in-groups") + `</div>` : '<p class="note">In no stored group gate.</p>';
    }
    main.innerHTML = `<div class="page-head"><h1>Layer ${layer} &middot; input feature #${f}</h1>${pager("in", layer, f, n)}</div>
      <p class="note">Site ${esc(site)}: a feature of the input SAE the circuits are read in.</p>
      <section id="feature" data-layer="${layer}" data-feature="${f}">${head.html}${labelSection(fi, site, f)}</section>
      <section id="builds">${builds}</section><section id="read-by">${reads}</section><section id="in-gates">${gates}</section>
      <section id="in-groups">${groups}</section>`;
  }

  // ------------------------------------------------------------------ layer page

  async function renderLayer(layer) {
    if (meta.layers.indexOf(layer) < 0) return notFound(`This run has no layer ${isNaN(layer) ? "of that name" : layer} (layers: ${meta.layers.join(", ") || "none"}).`);
    document.title = `Layer ${layer}`;
    const [F, V] = await Promise.all([need(`features_L${layer}`), needSite("verdicts", layer)]);
    const fi = featureIndex(F);
    const base = T(D.index.features), stats = T(D.index.stats[state.site]);
    const mine = rowsOf(base, "layer", layer);
    const pick = (name) => mine.map((i) => val(stats, name, i)).filter(isNum);
    const rank = D.index.corr_rank;
    const jobs = [];
    let html = `<div class="page-head"><h1>Layer ${layer}</h1><span class="pager">` +
      meta.layers.map((l) => (l === layer ? `<b>L${l}</b>` : `<a href="${link("/layer/" + l)}">L${l}</a>`)).join(" ") + `</span></div>` +
      `<p class="note">${mine.length} output features; circuits read through the input SAE on <b>${esc(state.site)}</b>.</p>`;
    const metrics = T(meta.sae_metrics);
    if (metrics) {
      const rows = rowsOf(metrics, "layer", layer).map((i) => rec(metrics, i));
      const keys = ["site", "d_sae", "k", "nmse", "l0", "dead_fraction", "loss_added"].filter((k) => k in metrics.columns);
      html += `<h2>SAEs</h2>` + tableHtml(keys.map((k) => (k === "site" ? "!site" : k)), rows.map((r) => keys.map((k) => fmt(r[k]))), "compact");
    } else html += `<h2>SAEs</h2>` + missingNote("sae_metrics");
    html += `<h2>Distributions</h2><div class="cols three">`;
    const hist = (id, values, title, what) => {
      if (!values.length) return `<div><h3>${esc(title)}</h3>${present(what) ? '<p class="note">No values in this layer.</p>' : missingNote(what)}</div>`;
      jobs.push(() => plot(id, [{ type: "histogram", x: values, nbinsx: 30, marker: { color: "#4a78a8" },
        hovertemplate: "%{x}: %{y} features<extra></extra>" }], { xaxis: { title: { text: title } }, yaxis: { title: { text: "features" } },
        margin: { l: 50, r: 10, t: 10, b: 45 }, bargap: 0.05 }));
      return `<div><h3>${esc(title)} <span class="note">(${values.length})</span></h3>${plotSlot(id, 240)}</div>`;
    };
    html += hist("hist-corr", pick("corr"), `rank-${rank} correlation`, "lowrank") + hist("hist-energy", pick("energy1"), "top eigenvalue's energy share", "eigen") +
      hist("hist-gate", pick("gate_share"), "circuit candidate pair's contribution share", "gate_verdicts") +
      hist("hist-group", pick("group_share"), "best group gate's contribution share", "gate_verdicts") + `</div>`;
    const curve = meta.lowrank[state.site] && meta.lowrank[state.site][String(layer)];
    if (curve) {
      html += `<h3>Mean active-only correlation by rank</h3><p class="note">${fmt(curve.nan_features)} of ${fmt(curve.features)} features have no correlation (too few active tokens) and are left out.</p>` + plotSlot("layer-curve", 240);
      jobs.push(() => plot("layer-curve", [{ type: "scatter", mode: "lines+markers", x: curve.n_eigs, y: curve.mean,
        hovertemplate: "r = %{x}: mean correlation %{y:.4g}<extra></extra>" }], { xaxis: { title: { text: "eigenpairs kept (r)" }, dtick: 1 },
        yaxis: { title: { text: "mean correlation" } }, margin: { l: 60, r: 10, t: 10, b: 45 } }));
    }
    html += `<h2 id="best-gates">Best circuit candidates</h2>`;
    const v = T(V && V.gate_verdicts);
    if (!v) html += missingNote("gate_verdicts", "verdicts (the gate_verdicts table: run the verdicts stage)",
                                "verdicts not run for this layer");
    else {
      html += `<p class="note">Each output feature's circuit candidate pair and its best group gate, ranked within the layer by
        what exact interventions show (<code>circuits.gates.ranking</code>: gate type and causal score less its sampling error, split ones last); verdicts
        from the model-run ablation of the best ones, on tokens the ranking never read.</p>`;
      for (const [kind, title] of [["pair", "Input pairs"], ["group", "Group gates"]]) {
        const ranked = rowsOf(v, "kind", kind).map((i) => rec(v, i)).sort((a, b) => a.circuit_rank - b.circuit_rank);
        html += `<h3>${title} <span class="note">(${ranked.length}${ranked.length > 100 ? ", the best 100 shown" : ""})</span></h3>` +
          (ranked.length ? `<div class="scroll tall">` + tableHtml(
          ["circuit rank", "!output feature", "!side a", "!side b", "!type", "causal score", "synergy", "gate_score",
           "contribution share", "and_data", "!verdict"],
          ranked.slice(0, 100).map((r) => [fmt(r.circuit_rank), outLink(layer, r.out_feature, fi, 40),
            (r.label_a ? esc(r.label_a) + ": " : "") + (kind === "pair" ? inLink(layer, r.in_a, fi, 25) : members(layer, r.members_a, fi)),
            (r.label_b ? esc(r.label_b) + ": " : "") + (kind === "pair" ? inLink(layer, r.in_b, fi, 25) : members(layer, r.members_b, fi)),
            esc(r.gate_type ?? ""), fmt(r.causal_score), fmt(r.synergy), fmt(r.gate_score), fmt(r.contribution_share),
            fmt(r.and_data),
            (r.is_and ? '<span class="tag yes">AND</span> ' : "") + (r.split_pair ? '<span class="tag no">split</span> ' : "") +
            gateTags(r).map((tag) => `<span class="tag yes">${esc(tag.name)}</span> `).join("") + esc(r.verdict)]), `best-${kind}s`) + `</div>`
          : '<p class="note">No ranked candidates of this kind in this layer.</p>');
      }
    }
    const hosvd = meta.hosvd && meta.hosvd[state.site] && meta.hosvd[state.site][String(layer)];
    if (hosvd) {
      html += `<h2>HOSVD singular values</h2>` + plotSlot("hosvd", 220);
      jobs.push(() => plot("hosvd", [{ type: "bar", y: hosvd, x: hosvd.map((_, k) => k) }], { xaxis: { title: { text: "component" } }, margin: { l: 50, r: 10, t: 10, b: 45 } }));
    }
    main.innerHTML = html;
    contentDone();
    await Promise.all(jobs.map((j) => j()));
  }

  // ------------------------------------------------------------------ routing

  function parseHash() {
    const h = location.hash.replace(/^#/, "");
    const [path, query] = h.split("?");
    return { parts: (path || "").split("/").filter(Boolean), params: new URLSearchParams(query || "") };
  }

  let contentAt = null;
  /* The page's text and tables are about to be shown (its plots may follow). */
  function contentDone() { contentAt = performance.now(); }

  async function route() {
    const t0 = performance.now();
    const token = ++state.routeToken;
    contentAt = null;
    main.dataset.ready = "0";
    const { parts, params } = parseHash();
    const wanted = params.get("in");
    state.site = wanted && meta.input_sites.indexOf(wanted) >= 0 ? wanted : meta.input_sites[0] || meta.default_input_site;
    renderHeader();
    // Plotly's first start takes about a second: fetch it alongside the data of a page with plots
    if (parts[0] === "out" || parts[0] === "layer") needPlotly();
    try {
      if (!parts.length) renderIndex();
      else if (parts[0] === "layer" && parts.length === 2) await renderLayer(toInt(parts[1]));
      else if (parts[0] === "out" && parts.length === 3) await renderOutput(toInt(parts[1]), toInt(parts[2]));
      else if (parts[0] === "in" && parts.length === 3) await renderInput(toInt(parts[1]), toInt(parts[2]));
      else notFound(`There is no page at "${location.hash}".`);
    } catch (error) {
      console.error(error);
      main.innerHTML = `<p class="missing">This page failed to render: ${esc(error && error.message)}</p>`;
    }
    if (token !== state.routeToken) return;
    const done = performance.now();
    const ms = done - t0, content = (contentAt || done) - t0;
    // ms: from the route's start; at: since the document started loading (for a first page)
    timings.push({ route: location.hash || "#/", ms, content, at: done });
    main.dataset.renderMs = ms.toFixed(1);
    main.dataset.contentMs = content.toFixed(1);
    main.dataset.ready = "1";
    if (!window.Plotly && meta.plotly) {
      // output feature and layer pages need Plotly, whose start-up takes about a second:
      // start it while the reader looks at a page without plots
      const later = window.requestIdleCallback || ((fn) => setTimeout(fn, 200));
      setTimeout(() => later(() => needPlotly(), { timeout: 2000 }), 1000);
    }
    if (parts.length) window.scrollTo(0, 0);
  }

  window.addEventListener("hashchange", route);
  route();
})();
