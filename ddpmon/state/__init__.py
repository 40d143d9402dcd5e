"""The state a rank publishes: the one schema of its state file, the files themselves, and
the embedded per-step history. Nothing here imports torch."""
