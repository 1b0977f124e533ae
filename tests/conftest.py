"""Hypothesis settings profiles, registered once and chosen by HYPOTHESIS_PROFILE (default: ci).

ci is the fast tier run by the default test command. It is derandomised (examples seeded by a
hash of each test, no example database), so two runs of the same commit test the same examples
and a red CI run is red again on a laptop; every counterexample ever found is pinned as an
@example next to its test, so derandomising loses none of them. thorough is a deliberate long
random search (a fresh seed each run, failures kept in the local .hypothesis/ database):
    HYPOTHESIS_PROFILE=thorough python -m pytest -q tests/impl/test_props_padding.py
A counterexample the thorough search finds gets pinned as an @example.
"""

import os

from hypothesis import HealthCheck, settings

# No deadline: the first example of a test pays for torch's lazy kernel set-up.
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True, database=None)
settings.register_profile(
    "thorough", max_examples=2000, deadline=None, derandomize=False, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
