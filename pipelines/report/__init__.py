"""The one-page HTML report of a run.

- `inputs`: the run's tables for the chosen layers, and the few numbers the tables do not
  hold (approximation-versus-activation points, interaction submatrices), computed with
  `circuits`;
- `config`: `ReportConfig`, what the report shows (apart, so a parser can offer its flags
  without importing matplotlib);
- `figures`: matplotlib figures drawn from plain arrays;
- `page`: `write_report`, which renders `templates/report.html` (jinja2, autoescaped).
"""
