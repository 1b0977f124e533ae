"""Implementations under test, behind one adapter interface (harness/adapters/base.py).

A user's adapter imports its pieces from here: `from harness.adapters import Ours, RankContext`.
"""

from harness.adapters.base import Adapter, RankContext, RawShard
from harness.adapters.ddp import DDP
from harness.adapters.fsdp2 import FSDP2
from harness.adapters.ours import Ours
from harness.adapters.single import Single

__all__ = ["Adapter", "DDP", "FSDP2", "Ours", "RankContext", "RawShard", "Single"]
