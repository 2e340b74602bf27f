"""Which groups reach which, kept as bitsets through the planner's merges.

The planner's closure of a candidate merge is every group on a path between two of its
groups. Searching the group graph for it per candidate per greedy iteration made planning
quadratic in graph size (MobileNetV2's training step: ~1500 merges x ~1000 candidates,
minutes of CPU). Here every group holds the set of its ancestors and of its descendants as
a Python int used as a bitset (bit ``g`` for group ``g``): a closure is two ORs and an AND,
and a merge updates only the ancestors' and descendants' sets.
"""
from __future__ import annotations


def bits(groups) -> int:
    out = 0
    for g in groups:
        out |= 1 << g
    return out


def members(mask: int):
    """The groups of a bitset, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class GroupReach:
    """Ancestors and descendants of every group of an acyclic group graph."""

    def __init__(self, succ: dict[int, set[int]], topo: dict[int, int]):
        order = sorted(succ, key=topo.__getitem__)
        self.desc: dict[int, int] = {}
        self.anc: dict[int, int] = {g: 0 for g in order}
        for g in reversed(order):
            d = 0
            for n in succ[g]:
                d |= self.desc[n] | (1 << n)
            self.desc[g] = d
        for g in order:
            up = self.anc[g] | (1 << g)
            for n in succ[g]:
                self.anc[n] |= up

    def between(self, inside: list[int]) -> int:
        """Groups on a path from one group of ``inside`` to another, outside it."""
        down = up = 0
        for g in inside:
            down |= self.desc[g]
            up |= self.anc[g]
        return down & up & ~bits(inside)

    def merge(self, gids: list[int], target: int) -> None:
        """``gids`` (target among them) became one group ``target``: paths through any of
        them now run through it, so its ancestors reach its descendants."""
        gone = bits(gids)
        keep = ~gone
        up = down = 0
        for g in gids:
            up |= self.anc.pop(g)
            down |= self.desc.pop(g)
        up &= keep
        down &= keep
        me = 1 << target
        for g in members(up):
            self.desc[g] = (self.desc[g] & keep) | me | down
        for g in members(down):
            self.anc[g] = (self.anc[g] & keep) | me | up
        self.anc[target], self.desc[target] = up, down
