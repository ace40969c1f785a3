"""pymem's exceptions."""
import torch


class OutOfBudgetError(torch.OutOfMemoryError):
    """A request cannot be met inside the budget, even after releasing everything releasable.

    Attributes (bytes): ``requested``, ``budget``, ``allocated``, ``pinned_bytes``,
    ``largest_free_block``. A subclass of ``torch.OutOfMemoryError``, so existing
    out-of-memory handlers keep working.
    """
