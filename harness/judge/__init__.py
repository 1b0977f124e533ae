"""The judge: the error model (tolerance), the per-step checks (diff), per-cell verdicts."""
