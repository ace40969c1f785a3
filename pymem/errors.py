"""pymem's exceptions."""
import torch


class OutOfBudgetError(torch.OutOfMemoryError):
    """A request cannot be met inside the budget, even after releasing everything releasable.

    Attributes (bytes): ``requested``, ``budget``, ``allocated``, ``pinned_bytes``,
    ``largest_free_block``. A subclass of ``torch.OutOfMemoryError``, so existing
    out-of-memory handlers keep working.
    """

    FIGURES = ("requested", "budget", "allocated", "pinned_bytes", "largest_free_block")

    @classmethod
    def from_cause(cls, message: str, cause: BaseException) -> "OutOfBudgetError":
        """A new error with ``message`` and the cause's figures (None where it has none)."""
        err = cls(message)
        for k in cls.FIGURES:
            setattr(err, k, getattr(cause, k, None))
        return err


class RestoreMismatchError(RuntimeError):
    """``verify=True``: a value pymem released came back (recomputed, or copied back) with other
    bytes than it held when it left. Training would have gone on with a wrong value; pymem stops
    there instead. Attributes: ``op`` (what made the value), ``nbytes``, ``how`` (``rematerialize``,
    ``swap in``, ``prefetch``)."""
