"""``python -m moe_lora_compile {demo,dump,tune,serve-bench}`` (also the ``moe-lora-compile`` console script).

- ``demo``: both ways in. First a tiny random MoE model (``--family``, Qwen3-MoE by default), three LoRA adapters
  made and saved with PEFT's own API and loaded into our attached model, compiled with the moe_lora pass, one
  mixed-adapter batch checked against the eager reference, and a short report (graphs, graph breaks, recompiles,
  fused ops, tokens/s). Then (unless ``--skip-peft``) a plain PEFT model of the same family compiled with
  ``torch.compile`` and the pass, checked against PEFT eager (:mod:`.peft_demo`). On a GPU the fused ops run the
  Triton kernels; on the CPU their reference impls.
- ``dump``: the same model compiled under ``depyf.prepare_debug(folder)``; prints where the fused ops are.
- ``tune``: the kernel tuner on a CUDA GPU, :mod:`moe_lora_compile.ops.triton.tune` (its own arguments and ``--help``).
- ``serve-bench``: ``benchmarks/bench_serving.py`` (the serving benchmark) with the options that follow; its tiny
  mode when there is no CUDA device.

``demo`` and ``dump`` parse their arguments before torch is imported (``--help`` answers at once; ``tune`` and
``serve-bench`` parse theirs in modules that import torch: a few seconds); the reports go to stdout, progress
lines for the slow steps to stderr (when it is a terminal, or with ``--verbose``); a bad argument or a missing CUDA
device is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import copy
import dataclasses
import os
import sys
import tempfile
import time
import warnings
from typing import TYPE_CHECKING, Optional, Sequence

from . import progress
from .family_names import canonical_family, describe_choices, family_arg

if TYPE_CHECKING:
    import torch

DESCRIPTION = ("Try moe_lora_compile on a tiny random MoE model: 'demo' compiles it with three PEFT adapters and "
               "checks a mixed batch against eager; 'dump' writes a depyf dump of the compiled model and says where "
               "the fused ops landed.")

ADAPTERS = ("alpha", "beta", "gamma")
ADAPTER_RANKS = (4, 8, 2)  # different ranks: the slots pad each to max_rank


@dataclasses.dataclass
class Setup:
    family: str
    device: torch.device
    base: torch.nn.Module  # the plain model (kept for eager comparison)
    model: object  # the MultiLoRAModel
    input_ids: torch.Tensor  # [B, S]
    adapters: list  # one name (or None) per sequence


def build(family: str, *, dtype: torch.dtype, device: torch.device, batch: int, seq_len: int,
          workdir: str, max_rank: int = 8, config_overrides: Optional[dict] = None,
          use_ops: bool = False) -> Setup:
    """Tiny ``family`` model, three PEFT adapters saved to ``workdir`` and loaded into an attached model.

    ``family``: a short name or a model_type (``llama4`` or ``llama4_text``); ``config_overrides`` go to
    :func:`~moe_lora_compile.models.tiny.tiny_config` (e.g. ``sliding_window``). ``use_ops`` goes to ``attach``;
    ``False`` here (unlike ``attach``'s default): the modules emit the reference, which the demo's pass fuses."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from .models import attach
    from .models.tiny import randomize_lora_, tiny_config, tiny_lora_config

    family = canonical_family(family)
    progress.say(f"building a tiny random {family} model and three PEFT adapters")
    torch.manual_seed(0)
    config = tiny_config(family, **(config_overrides or {}))
    base = AutoModelForCausalLM.from_config(config).eval().to(device=device, dtype=dtype)
    model = attach(copy.deepcopy(base), max_loras=4, max_rank=max_rank, use_ops=use_ops)
    for seed, (name, rank) in enumerate(zip(ADAPTERS, ADAPTER_RANKS)):
        with warnings.catch_warnings():  # PEFT 0.21 calls a property transformers 5.x deprecated; not ours
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            peft_model = get_peft_model(copy.deepcopy(base), tiny_lora_config(family, r=rank, lora_alpha=2 * rank))
        randomize_lora_(peft_model, seed=seed)
        path = os.path.join(workdir, name)
        peft_model.save_pretrained(path)
        model.load_adapter(name, path)
    vocab = base.config.vocab_size
    input_ids = torch.randint(3, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    adapters = [(list(ADAPTERS) + [None])[b % (len(ADAPTERS) + 1)] for b in range(batch)]
    return Setup(family, device, base, model, input_ids, adapters)


def _compile(setup: Setup):
    import torch

    from .compile import compile as compile_model
    from .passes import MoELoRAPass

    custom_pass = MoELoRAPass()
    compile_model(setup.model, fullgraph=True, options={"post_grad_custom_post_pass": custom_pass})
    torch._dynamo.mark_dynamic(setup.input_ids, 0)  # batch (token) dimension: one dynamic graph for all sizes
    return custom_pass


def _logits(setup: Setup, input_ids=None, adapters=None) -> torch.Tensor:
    import torch

    with torch.no_grad():
        return setup.model(setup.input_ids if input_ids is None else input_ids,
                           adapters=setup.adapters if adapters is None else adapters, use_cache=False).logits


def _tokens_per_s(fn, tokens: int, repeats: int = 3) -> float:
    import torch

    fn()  # warm
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return tokens * repeats / (time.perf_counter() - start)


def _dynamo_counts() -> tuple[int, int]:
    import torch

    counters = torch._dynamo.utils.counters
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def run_demo(family: str = "qwen3_moe", *, dtype: str = "float32", device: Optional[str] = None, batch: int = 4,
             seq_len: int = 8, workdir: Optional[str] = None, out=None, peft: bool = True) -> dict:
    """The demo; prints the report to ``out`` and returns it as a dict (the PEFT section's under ``"peft"``)."""
    import torch

    from .compile import pass_runs

    family = canonical_family(family)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        setup = build(family, dtype=getattr(torch, dtype), device=device, batch=batch, seq_len=seq_len,
                      workdir=workdir or tmp)
        eager = _logits(setup)
        eager_tps = _tokens_per_s(lambda: _logits(setup), setup.input_ids.numel())
        torch._dynamo.utils.counters.clear()
        custom_pass = _compile(setup)
        t0 = time.perf_counter()
        with pass_runs():  # a cache hit would skip the pass and its counts; compile() announces the compile
            compiled = _logits(setup)
        compile_s = time.perf_counter() - t0
        graphs, breaks = _dynamo_counts()
        # what must not recompile: another adapter mix, a hot-swapped adapter, another batch size
        progress.say("checking for recompiles (other adapter mix, hot swap, smaller batch) and timing")
        _logits(setup, adapters=list(reversed(setup.adapters)))
        setup.model.load_adapter(ADAPTERS[0], os.path.join(workdir or tmp, ADAPTERS[1]), replace=True)
        _logits(setup)
        smaller = setup.input_ids[: max(2, batch // 2)]
        _logits(setup, input_ids=smaller, adapters=setup.adapters[: smaller.shape[0]])
        recompiles = _dynamo_counts()[0] - graphs
        compiled_tps = _tokens_per_s(lambda: _logits(setup), setup.input_ids.numel())
    err = (compiled.float() - eager.float()).abs().max().item()
    tol = 1e-3 if dtype == "float32" else 5e-2 * max(1.0, eager.float().abs().max().item())
    fused_ops = dict(custom_pass.counts)
    moe_fused = not _has_experts(setup) or any(op.startswith("fused_moe_lora") for op in fused_ops)
    report = dict(family=family, device=str(device), dtype=dtype, batch=batch, seq_len=seq_len,
                  adapters=setup.adapters, graphs=graphs, graph_breaks=breaks, recompiles=recompiles,
                  fused_ops=fused_ops, moe_fused=moe_fused, max_abs_err=err, ok=err <= tol and moe_fused,
                  compile_s=compile_s, eager_tokens_per_s=eager_tps, compiled_tokens_per_s=compiled_tps,
                  total_s=time.perf_counter() - started)
    print(_format(report), file=out or sys.stdout)
    if peft:
        from .peft_demo import demo_section

        report["peft"] = demo_section(family, dtype=dtype, device=device, batch=batch, seq_len=seq_len, out=out)
    return report


def _format(r: dict) -> str:
    kernels = "Triton kernels" if r["device"].startswith("cuda") else "CPU reference impls"
    fused = ", ".join(f"{k} x{v}" for k, v in sorted(r["fused_ops"].items())) or "none"
    return "\n".join([
        f"moe_lora_compile demo: {r['family']} (tiny, random) on {r['device']}, {r['dtype']}, ops run {kernels}",
        f"  batch {r['batch']} x {r['seq_len']} tokens, adapters per sequence: {r['adapters']}",
        f"  graphs {r['graphs']}, graph breaks {r['graph_breaks']}, recompiles {r['recompiles']} "
        "(after: other adapter mix, hot-swapped adapter, smaller batch)",
        f"  fused ops: {fused}" + ("" if r["moe_fused"] else " -> MISSING fused_moe_lora (the pass rewrote no MoE "
                                                            "layer; MOE_LORA_PASS_LOG=1 says where it stopped)"),
        f"  compiled vs eager reference: max |diff| {r['max_abs_err']:.2e} -> {'OK' if r['ok'] else 'MISMATCH'}",
        f"  first compile {r['compile_s']:.1f} s; tokens/s eager {r['eager_tokens_per_s']:.0f}, "
        f"compiled {r['compiled_tokens_per_s']:.0f}; total {r['total_s']:.1f} s",
    ])


def run_dump(folder: str, family: str = "qwen3_moe", *, dtype: str = "float32", device: Optional[str] = None,
             out=None):
    """Compile the demo model under depyf and print where the fused ops are; returns the DumpReport."""
    import torch

    from .dump import dump_graphs

    family = canonical_family(family)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        setup = build(family, dtype=getattr(torch, dtype), device=device, batch=2, seq_len=8, workdir=tmp)
        _compile(setup)
        progress.say(f"writing a depyf dump into {folder}")
        report = dump_graphs(lambda: _logits(setup), (), folder)  # compile() announces the compile
        if _has_experts(setup):
            report.expected_ops = ("fused_moe_lora",)
    print(report.summary(), file=out or sys.stdout)
    return report


def _has_experts(setup: Setup) -> bool:
    """Whether the demo model has MoE experts with LoRA slots (every family but a dense one)."""
    return bool(setup.model.slots.experts_modules)


DEMO_MAX = 4096  # --batch / --seq-len of the demo: past this a typo, not a demo (2**70 failed deep in torch)


def int_at_least(low: int, why: str = "", high: Optional[int] = None):
    """argparse type: an int >= ``low`` (else the one-line usage error, with ``why`` after the bound) and, with
    ``high``, <= ``high``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}{f' ({why})' if why else ''}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high} (the demo's tiny model), got {value}")
        return value
    return parse


positive_int = int_at_least(1)


class OneLineParser(argparse.ArgumentParser):
    """Errors as one line on stderr (exit code 2), without the usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help for usage)\n")


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="moe-lora-compile", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,dump,tune,serve-bench}")
    for name, help_text in (("demo", "compile a tiny MoE model with three PEFT adapters and check it"),
                            ("dump", "write a depyf dump of the compiled demo model")):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--family", default="qwen3_moe", type=family_arg, metavar="F",
                       help=f"model family (default qwen3_moe): {describe_choices()}")
        dtype_note = "the check's tolerance follows it" if name == "demo" else "the dumped graphs compute in it"
        p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                       help=f"model and adapter dtype (default float32; {dtype_note})")
        p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
        p.add_argument("--verbose", action="store_true",
                       help="progress lines on stderr even when it is not a terminal (MOE_LORA_PROGRESS=1)")
        if name == "demo":
            p.add_argument("--batch", type=int_at_least(3, "the recompile checks need another batch size and "
                                                        "another adapter mix", high=DEMO_MAX), default=4,
                           help="sequences in the mixed batch, adapters assigned round-robin (default 4; the "
                                "recompile checks need >= 3: another batch size, another adapter mix)")
            p.add_argument("--seq-len", type=int_at_least(1, high=DEMO_MAX), default=8,
                           help=f"tokens per sequence (default 8, at most {DEMO_MAX})")
            p.add_argument("--skip-peft", action="store_true",
                           help="skip the second section (a plain PEFT model compiled with the pass)")
        else:
            p.add_argument("folder", help="where depyf writes the dump (only files written by this run count)")
    sub.add_parser("tune", add_help=False,  # main() hands its arguments to moe_lora_compile.ops.triton.tune
                   help="tune the Triton kernels' configs for a model on this GPU (`tune --help`)")
    sub.add_parser("serve-bench", add_help=False, help=SERVE_BENCH_HELP)  # its options: see run_serve_bench
    return parser


SERVE_BENCH_HELP = ("the serving benchmark (benchmarks/bench_serving.py: Poisson arrivals, no LoRA / 8 resident / 64 "
                    "paged / one adapter at a time); on a CPU its tiny mode; options after serve-bench go to it")


def run_serve_bench(argv: Sequence[str]) -> int:
    """``serve-bench [options]``: run ``benchmarks/bench_serving.py`` of this source checkout with ``argv`` (plus
    ``--tiny`` when there is no CUDA device); 2 with one line on stderr when the checkout has no such file."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                        "bench_serving.py")
    if not os.path.isfile(path):
        print(f"moe-lora-compile serve-bench: error: {path} not found (serve-bench runs the benchmark of a source "
              f"checkout)", file=sys.stderr)
        return 2
    argv = list(argv)
    if "--help" not in argv and "-h" not in argv and "--tiny" not in argv:
        import torch

        if not torch.cuda.is_available():
            progress.say("no CUDA device: serve-bench runs the tiny model on the CPU (--tiny)")
            argv.insert(0, "--tiny")
    spec = importlib.util.spec_from_file_location("bench_serving", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv, prog="moe-lora-compile serve-bench")


def _device_error(device: Optional[str]) -> Optional[str]:
    """Why ``device`` cannot be used here (one line), or None."""
    import torch

    if device is not None and not device.strip():
        return "--device is empty; leave it out for the CPU, or give cpu, cuda or cuda:N"
    try:
        dev = torch.device(device or "cpu")
    except RuntimeError as error:
        return f"--device {device!r}: {error}"
    if dev.type == "cpu" and dev.index not in (None, 0):  # torch takes any index; there is one CPU device
        return f"--device {device}: there is one CPU device (cpu or cpu:0)"
    if dev.type == "cuda" and not torch.cuda.is_available():
        build = "this torch is a CPU build" if torch.version.cuda is None else "no CUDA device is visible"
        return f"--device {device}: CUDA is not available ({build}); run without --device to use the CPU"
    if dev.type not in ("cpu", "cuda"):
        return f"--device {device}: the demo runs on cpu or cuda, not {dev.type}"
    return None


def _switch_error() -> Optional[str]:
    """A malformed on/off ``MOE_LORA_*`` variable (one line), or None."""
    from . import settings

    try:
        settings.check_switches()
    except ValueError as error:
        return str(error)
    return None


def _folder_error(folder: str) -> Optional[str]:
    """Why the dump cannot be written into ``folder`` (one line), or None: checked before the model is built, by
    creating the folder and a file in it (``os.access`` says yes to root everywhere, /proc included)."""
    if not folder.strip():
        return "the dump folder's name is empty"
    path = os.path.abspath(folder)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{folder}: {existing} is a file, not a folder"
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        return f"{folder}: cannot write there ({error.strerror or error})"
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["tune"], ["serve-bench"]) and (problem := _switch_error()):  # as demo / dump: one line
        print(f"moe-lora-compile {argv[0]}: error: {problem}", file=sys.stderr)
        return 2
    if argv[:1] == ["tune"]:  # the tuner parses its own arguments
        from .ops.triton.tune import main as tune

        return tune(argv[1:])
    if argv[:1] == ["serve-bench"]:  # its options belong to the benchmark's own parser
        return run_serve_bench(argv[1:])
    args = _parser().parse_args(argv)  # before torch loads: --help and bad arguments answer at once
    if args.verbose:
        os.environ["MOE_LORA_PROGRESS"] = "1"
    problem = _device_error(args.device) or _switch_error()
    if args.command == "dump" and not problem:  # depyf first: _folder_error creates the folder
        if importlib.util.find_spec("depyf") is None:
            problem = "depyf is not installed (pip install depyf; it is a dependency of this package)"
        else:
            problem = _folder_error(args.folder)
    if problem:
        print(f"moe-lora-compile {args.command}: error: {problem}", file=sys.stderr)
        return 2
    with progress.step("loading torch, transformers and peft"):
        import moe_lora_compile

        moe_lora_compile._load_all()  # registers torch.ops.moe_lora.* (deferred on the command line)
    if args.command == "demo":
        report = run_demo(args.family, dtype=args.dtype, device=args.device, batch=args.batch,
                          seq_len=args.seq_len, peft=not args.skip_peft)
        peft_ok = args.skip_peft or report["peft"]["ok"]
        one_graph = report["graphs"] == 1 and report["graph_breaks"] == 0 and report["recompiles"] == 0
        return 0 if report["ok"] and one_graph and peft_ok else 1
    report = run_dump(args.folder, args.family, dtype=args.dtype, device=args.device)
    return 0 if report.sites and not report.missing_ops() else 1


if __name__ == "__main__":
    sys.exit(main())
