"""Hypothesis settings profiles, registered once and chosen by HYPOTHESIS_PROFILE (default: ci).

ci is the fast tier run by the default test command; thorough is for a deliberate long search:
    HYPOTHESIS_PROFILE=thorough python -m pytest -q tests/test_props_padding.py
"""

import os

from hypothesis import HealthCheck, settings

# No deadline: the first example of a test pays for torch's lazy kernel set-up.
settings.register_profile("ci", max_examples=40, deadline=None)
settings.register_profile(
    "thorough", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
