"""CI verbs built on a run: gate, golden baselines, bisect, mutants."""
