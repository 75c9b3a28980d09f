"""The torch side's shared test helper: a module of bare parameters, driven
through the stock ``hvd.DistributedOptimizer`` by the torch integration tests
(kept apart from compression_cases.py, which the TF files import too)."""
import torch


class Params(torch.nn.Module):
    """Bare parameters of the given shapes; dotted names become submodules (so
    ``named_parameters()`` yields exactly the spec names)."""

    def __init__(self, specs):
        super().__init__()
        for name, shape in specs.items():
            parent = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, torch.nn.Module())
                parent = getattr(parent, part)
            parent.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape)))
