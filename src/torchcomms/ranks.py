"""The one rank vocabulary: how every layer names ranks in a message and writes rank sets down.

* ``ranks_text``: a message's name for ranks (``peer rank 2``, ``peer ranks 1, 3``; ``rank 2``
  with ``noun="rank"``), so a user greps one shape whichever layer raised;
* ``encode_ranks`` / ``decode_ranks``: a rank set on the wire or in a store (``1-4,7,9``);
* ``Ranks`` and ``RankMessage``: a message that names ranks, kept as data (a template and its
  arguments) until it is read, so a layer that knows the ranks under other numbers (a
  host's local ranks are comm ranks to the hierarchical path) renders it with its own
  numbering (``text(name)``) instead of rewriting another layer's text.

A leaf: imports nothing from ``torchcomms``; every layer, ``transport`` included, may import
it, and no other module formats, encodes or parses rank lists (``tests/test_layout.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

#: A renumbering of ranks: ``name(r)`` is how the reader knows rank ``r``.
Rename = Callable[[int], int]


def ranks_text(ranks: Iterable[int], noun: str = "peer rank") -> str:
    """``peer rank 2`` / ``peer ranks 1, 3`` (sorted, each once)."""
    unique = sorted(set(ranks))
    return f"{noun}{'s' if len(unique) > 1 else ''} {', '.join(map(str, unique))}"


def encode_ranks(ranks: Iterable[int]) -> str:
    """``1-4,9``: sorted ranks as ranges (``""`` for none)."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def decode_ranks(text: str | bytes) -> set[int]:
    """The ranks ``encode_ranks`` wrote (a store's value may come as bytes)."""
    raw = text.decode() if isinstance(text, bytes) else text
    out: set[int] = set()
    for part in raw.split(","):
        if part:
            first, _, last = part.partition("-")
            out.update(range(int(first), int(last or first) + 1))
    return out


class Named:
    """A part of a message that names ranks: rendered with the reader's numbering."""

    def text(self, name: Rename | None = None) -> str:
        raise NotImplementedError

    def __str__(self) -> str:
        return self.text()


class Ranks(Named):
    """A rank set in a message: ``ranks_text(ranks, noun)``, renumbered by ``name``."""

    __slots__ = ("noun", "ranks")

    def __init__(self, ranks: Iterable[int], noun: str = "peer rank") -> None:
        self.ranks = tuple(sorted(set(ranks)))
        self.noun = noun

    def text(self, name: Rename | None = None) -> str:
        return ranks_text(self.ranks if name is None else map(name, self.ranks), self.noun)


class RankMessage(Named):
    """``template.format(*args)``, where each ``Named`` argument (``Ranks``, another message)
    is rendered with the reader's numbering: ``RankMessage("{} died", Ranks([2]))``."""

    __slots__ = ("args", "template")

    def __init__(self, template: str, *args: object) -> None:
        self.template = template
        self.args = args

    def text(self, name: Rename | None = None) -> str:
        return self.template.format(
            *(a.text(name) if isinstance(a, Named) else a for a in self.args)
        )
