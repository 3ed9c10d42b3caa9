"""The run engine: where a run keeps its files, and the one way each stage writes, digests,
reuses and locks them.

- `paths`: the layout of a run directory;
- `files`: atomic writes of files and folders, content digests cached by size and mtime;
- `stamps`: a stage's outputs are reused only when the digest of its inputs matches;
- `lock`: one command at a time per run directory;
- `tables`: Parquet tables, one folder per layer.
"""
