"""The run pipeline: plan, one launch per world size, the rank runtime, snapshots on disk."""
