"""What the tables mean: output directions, feature descriptions, gate checks and verdicts."""
