"""The gate home: everything about candidate gates of an output, a pair of input latents or two
groups of them, each rule explained once, in its module:

- `pairs`: correlational statistics of candidate pairs on data (truth tables, `and_data`,
  contribution shares, `gate_score`);
- `groups`: the same for group gates (eigenvector reading sets, label classes);
- `interventions`: exact layer-local interventions, f with a side removed from the MLP input;
- `types`: the gate types and the causal score, from the interventions' truth table;
- `ranking`: every ranking: the gates table's weight-only `and_score` and its ranks, the
  split rule, and the circuit ranking pairs and group gates share.

Everything here is tensor or array math; the tables are built in `pipelines.analysis`.
"""
