"""Implementations under test, behind one adapter interface (harness/adapters/base.py).

A user's adapter subclasses `Adapter` and imports what it needs from here:
`from harness.adapters import Adapter, Padding, RankContext, RawShard`.
"""

from harness.adapters.base import Adapter, Padding, RankContext, RawShard
from harness.adapters.ddp import DDP
from harness.adapters.fsdp1 import FSDP1
from harness.adapters.fsdp2 import FSDP2
from harness.adapters.ours import Ours
from harness.adapters.single import Single

__all__ = ["Adapter", "DDP", "FSDP1", "FSDP2", "Ours", "Padding", "RankContext", "RawShard", "Single"]
