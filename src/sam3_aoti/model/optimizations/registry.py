"""The registry of optimizations: each one's name, transform, place in the order and what it changes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn


@dataclass(frozen=True)
class Optimization:
    name: str
    apply: Callable[[nn.Module], None]  # swaps its classes in on a `Sam3Model`'s instances
    after: tuple[str, ...] = ()  # optimizations that, when also on, must be applied before this one
    # parts of the grounding (`encode_image`, `decode`, ...) whose inputs or outputs it changes
    changes_parts: tuple[str, ...] = ()
    # per part, the `Sam3Model` submodules it makes that part read besides `grounding.PARTS`'
    part_reads: dict[str, tuple[str, ...]] = field(default_factory=dict)


REGISTRY: dict[str, Optimization] = {}


def register(name: str, after: tuple[str, ...] = (), changes_parts: tuple[str, ...] = (),
             part_reads: dict[str, tuple[str, ...]] | None = None):
    """Registers the decorated `apply(model)` under `name`, after every optimization it names in `after`."""

    def decorate(apply):
        missing = [other for other in after if other not in REGISTRY]
        if missing:
            raise RuntimeError(f"optimization {name} must be registered after {missing}")
        REGISTRY[name] = Optimization(name, apply, tuple(after), tuple(changes_parts), dict(part_reads or {}))
        return apply

    return decorate


def optimize(model: nn.Module, names) -> None:
    """Apply the optimizations `names` to `model`, in the registry's order."""
    unknown = set(names) - set(REGISTRY)
    if unknown:
        raise ValueError(f"unknown optimizations {sorted(unknown)}: choose from {list(REGISTRY)}")
    for name, optimization in REGISTRY.items():
        if name in names:
            optimization.apply(model)


def part_submodules(names, part: str) -> tuple[str, ...]:
    """The submodules the optimizations `names` add to what `part` reads."""
    return tuple(path for name in REGISTRY if name in names for path in REGISTRY[name].part_reads.get(part, ()))
