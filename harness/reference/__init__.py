"""The reference a sharded run is judged against, below both the rank runtime (harness/run/) and
the judge (harness/judge/): the error model (tolerance.py: how far an honest run may be from the
unsharded one) and the unsharded replay of every step (shadow.py). It imports only adapters/
(the local step, mixed-precision compute), cases/ and errors; tests/harness/test_walls.py keeps it so."""
