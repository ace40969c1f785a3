"""Optimizer steps, seen through torch.optim's global step hooks (every ``torch.optim.Optimizer``,
custom subclasses included). While one runs, its ops get no recipes although they run under
no_grad like inference: what a step writes is the next step's leaves, and recipes for its in-place
updates would chain each step's state to the step before."""
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook


class OptimizerSteps:
    """Counts ``rt.no_recipes`` up and down around each step while installed, and marks the end of
    a step in the step trace after each."""

    def __init__(self, rt) -> None:
        self.rt = rt
        self._handles = []

    def install(self) -> None:
        rt = self.rt

        def pre(optimizer, args, kwargs):
            rt.no_recipes += 1

        def post(optimizer, args, kwargs):
            rt.no_recipes = max(0, rt.no_recipes - 1)
            rt.end_step()  # a training step ends with its optimizer's step

        self._handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]

    def uninstall(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
