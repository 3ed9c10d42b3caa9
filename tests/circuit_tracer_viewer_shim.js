// Served in place of the viewer's web-hosted jetpack build in the browser test (tests/test_graph.py).
// npm's d3-jetpack bundle, served as d3.js, already gives the selection helpers and a d3.conventions
// that lays out svg, canvas and div layers; the viewer also asks the result to draw its axes.
(function () {
  const layout = d3.conventions
  d3.conventions = function (options) {
    const c = layout(options)
    // x axis along the bottom edge, y axis along the left one, into `sel` (the first svg layer by default)
    c.drawAxis = function (sel = c.svg) {
      sel.append('g.x.axis').translate([0, c.height]).call(c.xAxis)
      sel.append('g.y.axis').call(c.yAxis)
    }
    return c
  }
})()
