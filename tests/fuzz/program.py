"""A generated program: input specs, straight-line statements, outputs.

Statements are Python source lines over named values (inputs ``x0, x1, ...``,
results ``v0, v1, ...``); dtypes are written as codes (``f16``, ``i64``, ...)
bound in the namespace ``check.namespace`` builds, so the float64 reference
runs the very same text.
"""
from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass
class Statement:
    text: str  # "v3 = torch.exp(v1)" or "x0.mul_(2.0)"
    defines: str | None  # the value it defines, None for an in-place statement
    uses: list[str]
    family: str  # "unary", "binary", "reduction", ... (see generator.FAMILIES)
    mutates: str | None = None  # the value an in-place statement writes

    def renamed(self, old: str, new: str) -> "Statement":
        pattern = rf"\b{re.escape(old)}\b"
        text = re.sub(pattern, new, self.text.split(" = ", 1)[1]) if self.defines else \
            re.sub(pattern, new, self.text)
        if self.defines:
            text = f"{self.defines} = {text}"
        return dataclasses.replace(
            self, text=text, uses=[new if u == old else u for u in self.uses],
            mutates=new if self.mutates == old else self.mutates)


@dataclasses.dataclass
class Program:
    seed: int
    inputs: list[dict]  # check.make_input specs
    statements: list[Statement]
    outputs: list[str]
    backward: bool
    # check.reference's results per size variant, from the generator's validation (the
    # runner reuses them); not copied by dataclasses.replace, so an edited program has none
    refs: dict | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def source(self) -> str:
        args = ", ".join(s["name"] for s in self.inputs)
        body = [f"    {s.text}" for s in self.statements]
        outs = ", ".join(self.outputs)
        return f"def fn({args}):\n" + "\n".join(body) + f"\n    return ({outs},)\n"

    def case(self) -> dict:
        return {"seed": self.seed, "source": self.source, "inputs": self.inputs,
                "backward": self.backward}

    @property
    def families(self) -> set[str]:
        return {s.family for s in self.statements}

    @property
    def special(self) -> bool:
        return any(s.get("special") for s in self.inputs)

    @classmethod
    def from_case(cls, case: dict) -> "Program":
        """The Program of a case dict (a repro's CASE), its statements re-parsed."""
        lines = case["source"].splitlines()
        outputs = re.findall(r"\b[xv]\d+\b", lines[-1])
        statements = []
        for line in lines[1:-1]:
            text = line.strip()
            target, _, expr = text.partition(" = ")
            defines = target if re.fullmatch(r"v\d+", target) else None
            uses = re.findall(r"\b[xv]\d+\b", expr if defines else text)
            mutates = None if defines else uses[0]
            statements.append(Statement(text, defines, list(dict.fromkeys(uses)), "?", mutates))
        return cls(case["seed"], case["inputs"], statements, outputs, case["backward"])

    def pruned(self, outputs: list[str]) -> "Program":
        """The program returning only ``outputs``, without statements nothing returned
        depends on (in-place writes to inputs are kept: they are observable)."""
        live = set(outputs)
        kept = []
        input_names = {s["name"] for s in self.inputs}
        for s in reversed(self.statements):
            if (s.defines in live) or (s.mutates and (s.mutates in live or
                                                      s.mutates in input_names)):
                kept.append(s)
                live.update(s.uses)
        kept.reverse()
        return dataclasses.replace(self, statements=kept, outputs=list(outputs))

    def without(self, index: int, replacement: str) -> "Program":
        """The program with statement ``index`` removed and its value replaced by
        ``replacement`` (one of its operands) in later statements and outputs."""
        gone = self.statements[index]
        later = [s.renamed(gone.defines, replacement) for s in self.statements[index + 1:]]
        outputs = list(dict.fromkeys(replacement if o == gone.defines else o
                                     for o in self.outputs))
        return dataclasses.replace(self, statements=self.statements[:index] + later,
                                   outputs=outputs)
