"""Name templates: a lock name made from values, as ``"invoice:{invoice_id}"``.

``@locked``, ``@locked_task`` and ``FencedModel.fence_name`` all name a lock with a
``str.format`` template. They share this one parser, so what a template may contain, the
errors for a bad one and the way a name is formatted cannot drift apart.
"""

from __future__ import annotations

import inspect
import string
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["NameTemplate"]


class NameTemplate:
    """A ``str.format`` template for lock names, parsed once at decoration.

    ``fields`` holds the names the template needs (``{invoice.id}`` needs ``invoice``);
    ``parts`` is the template as (literal text, field or None) pairs. With ``plain=True``
    only bare identifiers are allowed (``{pk}``, ``{customer_id}``): no format spec,
    conversion, position, index or attribute, for templates that must also be written
    as SQL (``fence_name``). ``what`` names the template in error messages.

    Raises TypeError if ``template`` is not a str, ValueError if it is empty, malformed
    or has an unnamed field (``{}``, and in plain mode anything but a bare name).
    """

    __slots__ = ("fields", "parts", "template", "what")

    def __init__(
        self, template: object, *, plain: bool = False, what: str = "lock name template",
        example: str = "customer_id",
    ) -> None:
        if not isinstance(template, str):
            raise TypeError(f"{what} must be a str, not {type(template).__name__}")
        if not template:
            raise ValueError(f"{what} must not be empty")
        parts: list[tuple[str, str | None]] = []
        for literal, field, spec, conversion in string.Formatter().parse(template):
            if field is not None:
                if plain:
                    _check_plain(template, what, field, spec, conversion)
                elif not field.split(".")[0].split("[")[0]:
                    raise ValueError(f"{what} fields must be named, e.g. {{{example}}}")
            parts.append((literal, field))
        self.template = template
        self.what = what
        self.parts: tuple[tuple[str, str | None], ...] = tuple(parts)
        self.fields: frozenset[str] = frozenset(
            field.split(".")[0].split("[")[0] for _, field in parts if field is not None
        )

    def __repr__(self) -> str:
        return f"NameTemplate({self.template!r})"

    def check_parameters(self, parameters: Iterable[str], function: str) -> None:
        """Raise ValueError if a field is not among ``parameters`` of ``function``."""
        missing = self.fields - set(parameters)
        if missing:
            raise ValueError(
                f"lock name {self.template!r} uses {sorted(missing)}, which "
                f"{function}() has no parameters for"
            )

    def format(self, values: Mapping[str, Any]) -> str:
        """The name for ``values`` (a mapping of field name to value)."""
        return self.template.format(**values)

    def format_call(
        self, signature: inspect.Signature, args: tuple[Any, ...], kwargs: Mapping[str, Any],
    ) -> str:
        """The name for a call with ``args``/``kwargs``, defaults filled in."""
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return self.format(bound.arguments)


def _check_plain(
    template: str, what: str, field: str, spec: str | None, conversion: str | None,
) -> None:
    if not field.isidentifier():
        raise ValueError(
            f"{what} {template!r}: field {{{field}}} must be a field name "
            "such as {pk} or {customer_id} (no positions, indexes or attributes)"
        )
    if spec or conversion:
        raise ValueError(
            f"{what} {template!r}: field {{{field}}} must not have a format "
            "spec or conversion"
        )
