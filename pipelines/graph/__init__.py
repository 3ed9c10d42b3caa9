"""`bilinear-circuits graph`: exact attribution graphs of prompts (math in `circuits.attribution`),
written in circuit-tracer's graph format and as Parquet tables, and served in circuit-tracer's viewer."""
