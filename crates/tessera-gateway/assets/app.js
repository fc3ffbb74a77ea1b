// Live updates for the Tessera dashboard: one server-sent event per second carrying the status
// numbers and the node, plan and request sections already rendered by the server.
(function () {
  "use strict";
  var live = document.getElementById("live");
  var spark = document.getElementById("spark");

  function setHtml(id, html) {
    var el = document.getElementById(id);
    if (el && el.innerHTML !== html) el.innerHTML = html;
  }

  function drawSpark(values) {
    if (!spark || !values || !values.length) return;
    var w = 600, h = 80, max = 1;
    values.forEach(function (v) { if (v > max) max = v; });
    var step = w / Math.max(values.length - 1, 1);
    var pts = values.map(function (v, i) {
      return (i * step).toFixed(1) + "," + (h - 4 - (v / max) * (h - 12)).toFixed(1);
    });
    spark.querySelector(".line").setAttribute("d", "M" + pts.join(" L"));
    spark.querySelector(".area").setAttribute("d", "M0," + h + " L" + pts.join(" L") + " L" + w + "," + h + " Z");
  }

  function apply(u) {
    var s = u.status, c = s.cluster;
    setHtml("kpis", u.html.kpis);
    setHtml("nodes", u.html.nodes);
    setHtml("plan-section", u.html.plan);
    setHtml("requests", u.html.requests);
    document.getElementById("epoch").textContent = c.plan ? c.plan.epoch : 0;
    document.getElementById("node-count").textContent = c.nodes.length;
    var pill = document.getElementById("serving");
    if (c.not_serving) { pill.className = "pill bad"; pill.textContent = "Not serving: " + c.not_serving; }
    else { pill.className = "pill ok"; pill.textContent = "Serving"; }
    drawSpark(s.gateway.tokens_per_s_history);
  }

  function connect() {
    if (!window.EventSource) return poll();
    var es = new EventSource("/api/status/stream");
    es.addEventListener("status", function (e) {
      live.classList.add("on");
      try { apply(JSON.parse(e.data)); } catch (err) { console.error(err); }
    });
    es.onerror = function () { live.classList.remove("on"); };
  }

  function poll() {
    fetch("/api/status").then(function (r) { return r.json(); }).then(function (s) {
      drawSpark(s.gateway.tokens_per_s_history);
    }).finally(function () { setTimeout(poll, 2000); });
  }

  drawSpark([0, 0]);
  connect();
})();
