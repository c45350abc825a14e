"""The transfer layer under every face: requests -> keys -> ownership -> exists-skip -> addresses ->
batched puts and gets. See :mod:`kvflow.transfer.core` for what it owns and who may call it."""

from kvflow.transfer.batches import is_programming_error, run_batches
from kvflow.transfer.budget import ByteBudget
from kvflow.transfer.core import Transfer, Unit
from kvflow.transfer.jobs import LoadJob, StoreJob
from kvflow.transfer.plan import BlockPlan, Hashing, request_hashes
from kvflow.transfer.spec import TransferSpec

__all__ = [
    "BlockPlan",
    "ByteBudget",
    "Hashing",
    "LoadJob",
    "StoreJob",
    "Transfer",
    "TransferSpec",
    "Unit",
    "is_programming_error",
    "request_hashes",
    "run_batches",
]
