"""Reading an object's block with its model: one error type, naming the field.

Why: what a node writes is input to the operator (and what the operator writes is input to a
node). Both read it with a ``kube`` model, and a block of another shape must be refused the
same way everywhere: ``ShapeError("status.inventory.gpus[0].memoryMiB: required")``.

What it must never do: guess a value for a bad field, or raise anything but ``ShapeError``.
"""

from __future__ import annotations

from typing import TypeVar

import pydantic

from bettercompute.core import validation

Model = TypeVar("Model", bound=pydantic.BaseModel)


class ShapeError(ValueError):
    """A block that does not have the CRD's shape; the message names the field and why."""


def parse(model: type[Model], raw: object, *, under: str) -> Model:
    """``raw`` (the block at ``under``, such as ``status``) checked by ``model``; an absent
    block reads as an empty one."""
    try:
        return model.model_validate(raw if raw is not None else {})
    except pydantic.ValidationError as e:
        loc, reason = validation.first_problem(e, model)
        raise ShapeError(f"{validation.path(loc, under=under)}: {reason}") from e
