"""Root conftest: options and markers shared by the test tiers (see tests/README.md)."""

import os

# Pin intra-op threads before torch spins up its pool: equal thread counts in every process keep
# float reduction order, and so results, identical across world sizes.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser):
    parser.addoption("--world-sizes", default="1,2,4,8", help="world sizes of the slow matrix tests")
    parser.addoption("--impls", default="ours,fsdp2", help="implementations of the slow matrix tests")
