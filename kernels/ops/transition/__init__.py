"""Transition operators (scalar, vector, matrix) and composition of (T, S) pairs."""

from hybridcache.kernels.ops.transition.naive import (
    apply_segment,
    apply_transition,
    compose,
    compose_many,
    compose_transitions,
    transition_kind,
)

__all__ = ["apply_segment", "apply_transition", "compose", "compose_many", "compose_transitions", "transition_kind"]
