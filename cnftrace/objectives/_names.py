"""The objectives' names, as `fit`, `Trainer` and the command line take them."""

from ._base import AbstractObjective
from ._likelihood import MaximumLikelihood
from ._matching import BY_NAME

# Each name and the objective it stands for.
OBJECTIVES = {"mle": MaximumLikelihood(), **BY_NAME}


def resolve_objective(objective) -> AbstractObjective:
    """An objective, or one of the names that stand for one (`OBJECTIVES`)."""
    if isinstance(objective, AbstractObjective):
        return objective
    if isinstance(objective, str) and objective in OBJECTIVES:
        return OBJECTIVES[objective]
    raise ValueError(
        f"`objective` must be one of {', '.join(map(repr, OBJECTIVES))} or an "
        "objective such as `cnftrace.MaximumLikelihood(...)` or "
        f"`cnftrace.FlowMatching(...)`; got {objective!r}."
    )
