"""Which parameters a torch DistributedOptimizer reduces, and under which names.

Shared by the gradient-averaging optimizer (``hvdlite.torch.optimizer``) and the Adasum
one (``hvdlite.torch.adasum``), so both check their arguments alike.
"""


def check_backward_passes(backward_passes_per_step):
    """Raises ValueError unless ``backward_passes_per_step`` is at least 1."""
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got "
                         f"{backward_passes_per_step}")


def name_parameters(named_parameters, all_params):
    """Returns {parameter: name}: the names of ``named_parameters``, or automatic ones.

    Raises:
        ValueError: not (name, parameter) tuples, duplicate names, or parameters of
            the optimizer missing from it.
    """
    if named_parameters is None:
        return {p: f"grad.noname.{i}" for i, p in enumerate(all_params)}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError("named_parameters should be a sequence of (name, parameter) "
                         "tuples, usually model.named_parameters()")
    names = [name for name, _ in named]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError("parameter names in named_parameters must be unique; "
                         f"duplicates: {', '.join(duplicates)}")
    by_param = {p: name for name, p in named}
    unnamed = [p for p in all_params if p not in by_param]
    if unnamed:
        raise ValueError(f"named_parameters was given, but {len(unnamed)} of the "
                         "optimizer's parameters are not in it (shapes "
                         f"{[tuple(p.shape) for p in unnamed][:5]})")
    return by_param
