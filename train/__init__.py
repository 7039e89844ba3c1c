"""Training: run configs, data, the jitted train step, checkpoints, metrics, and the `relaymoe-train` CLI."""
