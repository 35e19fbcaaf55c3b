"""Look at what the compiler made: ``dump_graphs`` runs a compiled model under ``depyf.prepare_debug`` and says
where the ``torch.ops.moe_lora`` ops landed in the dumped post-grad graphs (``*AFTER_POST_GRAD*.py``)."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Optional, Sequence

import torch

_OP_CALL = re.compile(r"torch\.ops\.moe_lora\.(\w+)")


@dataclasses.dataclass
class FusedOpSite:
    file: str
    line: int
    op: str

    def __str__(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}: moe_lora.{self.op}"


@dataclasses.dataclass
class DumpReport:
    folder: str
    files: list[str]
    post_grad_files: list[str]
    sites: list[FusedOpSite]

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for site in self.sites:
            counts[site.op] = counts.get(site.op, 0) + 1
        return counts

    def summary(self) -> str:
        lines = [f"depyf dump in {self.folder}: {len(self.files)} files, "
                 f"{len(self.post_grad_files)} post-grad graph(s)"]
        counts = self.op_counts()
        lines.append("fused ops: " + (", ".join(f"{op} x{n}" for op, n in sorted(counts.items())) or "none"))
        lines += [f"  {site}" for site in self.sites]
        return "\n".join(lines)


def find_fused_ops(folder: str) -> DumpReport:
    """Scan a depyf dump folder for ``torch.ops.moe_lora.*`` calls in the post-grad graphs."""
    files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".py"))
    post_grad = [f for f in files if "AFTER_POST_GRAD" in os.path.basename(f)]
    sites = []
    for path in post_grad:
        with open(path) as f:
            for number, text in enumerate(f, start=1):
                code = text.split("#", 1)[0]  # stack-trace comments name our modules too
                sites += [FusedOpSite(path, number, m.group(1)) for m in _OP_CALL.finditer(code)]
    return DumpReport(folder, files, post_grad, sites)


def dump_graphs(compiled: Any, example_inputs: Sequence, folder: str, *,
                example_kwargs: Optional[dict] = None) -> DumpReport:
    """Run ``compiled(*example_inputs, **example_kwargs)`` under ``depyf.prepare_debug(folder)`` and report where
    the fused ops are. Call it for the first run of ``compiled`` (a graph compiled before is not dumped again);
    the FX-graph and AOT caches are off meanwhile so the post-grad graph is really built and written."""
    import depyf

    from .compile import pass_runs

    os.makedirs(folder, exist_ok=True)
    with pass_runs(), depyf.prepare_debug(folder):
        compiled(*example_inputs, **(example_kwargs or {}))
    return find_fused_ops(folder)
