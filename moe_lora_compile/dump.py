"""Look at what the compiler made: ``dump_graphs`` runs a compiled model under ``depyf.prepare_debug`` and says
where the ``torch.ops.moe_lora`` ops landed in the dumped post-grad graphs (``*AFTER_POST_GRAD*.py``)."""

from __future__ import annotations

import contextlib
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
    files: list[str]  # the files this dump wrote (older files in the folder are not counted)
    post_grad_files: list[str]
    sites: list[FusedOpSite]
    recompiled: bool = False  # Dynamo's cache answered the first run: its caches were reset and it compiled again
    expected_ops: tuple[str, ...] = ()  # ops the caller knows the graphs must hold (the MoE op of an MoE model)

    def missing_ops(self) -> list[str]:
        """The ``expected_ops`` that no site calls."""
        found = {site.op for site in self.sites}
        return [op for op in self.expected_ops if op not in found]

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for site in self.sites:
            counts[site.op] = counts.get(site.op, 0) + 1
        return counts

    def summary(self) -> str:
        lines = [f"depyf dump in {self.folder}: {len(self.files)} files, "
                 f"{len(self.post_grad_files)} post-grad graph(s)"]
        if self.recompiled:
            lines.append("(the model had compiled before this call: torch.compiler.reset() cleared Dynamo's caches "
                         "and it compiled again under depyf)")
        if not self.files:
            lines.append("nothing was traced: is the callable compiled (mlc.compile or torch.compile)?")
        elif not self.post_grad_files:
            lines.append("no post-grad graph was written: is the callable compiled with the Inductor backend "
                         "(mlc.compile, or torch.compile with the default backend)?")
        counts = self.op_counts()
        lines.append("fused ops: " + (", ".join(f"{op} x{n}" for op, n in sorted(counts.items())) or "none"))
        if self.missing_ops():
            lines.append(f"MISSING: {', '.join(self.missing_ops())} (the fusion pass did not rewrite this model's "
                         f"layers; MOE_LORA_PASS_LOG=1 says where its matchers stopped)")
        lines += [f"  {site}" for site in self.sites]
        return "\n".join(lines)


def _snapshot(folder: str) -> dict[str, tuple[int, int]]:
    """``{path: (mtime_ns, size)}`` of the ``.py`` files in ``folder`` (empty if it does not exist)."""
    if not os.path.isdir(folder):
        return {}
    out = {}
    for name in os.listdir(folder):
        if name.endswith(".py"):
            st = os.stat(os.path.join(folder, name))
            out[os.path.join(folder, name)] = (st.st_mtime_ns, st.st_size)
    return out


def find_fused_ops(folder: str, *, since: Optional[dict] = None, written: Optional[set] = None) -> DumpReport:
    """Scan a depyf dump folder for ``torch.ops.moe_lora.*`` calls in the post-grad graphs.

    ``since``: a snapshot taken before the dump (``_snapshot``); files it lists unchanged are stale, not counted,
    unless ``written`` (real paths depyf wrote or found already there with the same text, ``_recording_writes``)
    names them."""
    since, written = since or {}, written or set()
    files = sorted(path for path, stamp in _snapshot(folder).items()
                   if since.get(path) != stamp or os.path.realpath(path) in written)
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
    the fused ops are (only files this call writes count, not older ones in ``folder``). The FX-graph and AOT caches
    are off meanwhile so the post-grad graph is really built and written.

    Best called for the first run of ``compiled``. If it has run before with these inputs, Dynamo's cache answers
    and nothing is written; then ``torch.compiler.reset()`` clears Dynamo's caches (every compiled callable in the
    process compiles again on its next call) and the call is repeated under depyf (``report.recompiled`` when that
    compiled a graph). A callable that is not compiled writes nothing either way (and costs that reset); one
    compiled with another backend than Inductor writes Dynamo's files but no post-grad graph, and is not reset."""
    import depyf

    from .compile import pass_runs

    os.makedirs(folder, exist_ok=True)
    report = _dump_once(depyf, pass_runs, compiled, example_inputs, example_kwargs, folder)
    if not report.files:  # Dynamo's cache answered (or nothing is compiled): compile again under depyf
        torch.compiler.reset()
        report = _dump_once(depyf, pass_runs, compiled, example_inputs, example_kwargs, folder)
        report.recompiled = bool(report.files)
    return report


def _dump_once(depyf, pass_runs, compiled, example_inputs, example_kwargs, folder) -> DumpReport:
    before = _snapshot(folder)
    with pass_runs(), _recording_writes() as written, depyf.prepare_debug(folder):
        compiled(*example_inputs, **(example_kwargs or {}))
    return find_fused_ops(folder, since=before, written=written)


@contextlib.contextmanager
def _recording_writes():
    """Collect the real paths depyf's ``write_code_to_file_template`` returns. It leaves a file that already holds
    the same text untouched (same mtime and size: a re-run into the same folder), so the snapshot alone would call
    that file stale. depyf imports the function where it calls it, so patching the module attribute reaches it."""
    try:
        from depyf.explain import utils
    except ImportError:
        utils = None
    write, written = getattr(utils, "write_code_to_file_template", None), set()
    if write is None:  # another depyf: the snapshot alone decides (a re-run into the same folder reads as stale)
        yield written
        return

    def recording(src, path_template):
        path = write(src, path_template)
        written.add(os.path.realpath(path))
        return path

    utils.write_code_to_file_template = recording
    try:
        yield written
    finally:
        utils.write_code_to_file_template = write
