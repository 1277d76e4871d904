"""The ``fuselight`` command line: compile, demo, bench, explain, report, audit-pdl.

Bad input (unknown preset, bad config field, unsupported target, arch, dtype or quantization, a
library built for another GPU) prints ``error: ...`` in one line and exits with code 2. Compiler-side modules are
imported inside the commands that need them: ``bench run`` and ``bench e2e`` run on a GPU host that
has only the TVM runtime.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from .errors import FuselightError

PTX_HELP = ("carry the CUDA as PTX for --arch (compute_XX), compiled by the driver when loaded: a newer GPU "
            "runs that arch's code (with --accept-ptx on the GPU host, for tests and benchmarks)")
ACCEPT_PTX_HELP = ("also run libraries built with --ptx for an older GPU, as its proxy (results mark the device "
                   "'(sm_XX PTX)'; also $FUSELIGHT_ACCEPT_PTX=1)")


def _model_config(spec: str, dtype: str | None, quantization: str | None = None):
    from . import config
    from .quantization import scheme

    cfg = config.load(spec)
    cfg = cfg.with_dtype(dtype) if dtype else cfg
    s = scheme(quantization)
    if s is not None and dtype and dtype != s.model_dtype:
        raise FuselightError(f"--quantization {s.name} computes in {s.model_dtype}, not --dtype {dtype}")
    return cfg.with_quantization(quantization)


def cmd_compile(args: argparse.Namespace) -> int:
    from . import compile as fc
    from .target import resolve

    cfg = _model_config(args.model, args.dtype, args.quantization)
    spec = resolve(args.target, args.arch, ptx=args.ptx)
    if args.pipeline == "fuselight" and not spec.described:
        print(fc.UNDESCRIBED.format(arch=spec.arch))
    options = None
    whole_step = args.whole_step_graph
    if args.passes is not None or args.no_rules or args.no_programmatic_launch or whole_step is not None:
        passes = None if args.passes is None else tuple(p for p in args.passes.split(",") if p and p != "none")
        if whole_step is not None:
            from .passes import DEFAULT

            # named either way, so the build's decode-form rule does not choose it
            passes = tuple(p for p in (DEFAULT if passes is None else passes) if p != fc.WHOLE_STEP_PASS)
            passes = (*passes, fc.WHOLE_STEP_PASS) if whole_step else passes
        options = fc.Options(passes=passes, rules=() if args.no_rules else None,
                             programmatic_launch=not args.no_programmatic_launch)
    built = fc.build(cfg, spec, args.pipeline, options=options, cuda_graph=args.cuda_graph)
    out = fc.export(built, Path(args.output), aot_cuda=not args.no_aot)
    s = built.stats
    print(
        f"{out}: {cfg.name} {cfg.quantization or cfg.dtype} {spec.name} pipeline={args.pipeline} kernels={s.kernels} "
        f"launches/decode-step={s.launches_per_decode_step} ({built.compile_seconds:.1f} s)"
    )
    return 0


def _accept_ptx(args: argparse.Namespace) -> bool:
    """``--accept-ptx``, or ``$FUSELIGHT_ACCEPT_PTX=1``: run PTX libraries built for an older GPU."""
    from .runtime import accept_ptx_from_env

    return args.accept_ptx or accept_ptx_from_env()


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(_model_config(args.model, args.dtype), prompt_len=args.prompt_len, decode_steps=args.decode_steps, seed=args.seed)
    return 0


def _output(args: argparse.Namespace) -> Path | None:
    """``-o``; None: the suite's file under bench/results/<device>/."""
    return Path(args.output) if args.output else None


def cmd_bench_build(args: argparse.Namespace) -> int:
    from .bench.kernels_build import build_suite

    manifest = build_suite(Path(args.out), target_arch=args.arch, cases=args.cases, suite=args.suite, ptx=args.ptx)
    print(f"kernel suite built: {manifest}")
    return 0


def cmd_bench_run(args: argparse.Namespace) -> int:
    from .bench.kernels_run import run_suite

    run_suite(Path(args.manifest), _output(args), cases=args.cases, sweep=args.sweep, accept_ptx=_accept_ptx(args))
    return 0


def cmd_bench_paged_build(args: argparse.Namespace) -> int:
    from .bench.paged_attention import build_gpu_tier, build_suite

    if args.gpu_tier:
        manifests = build_gpu_tier(Path(args.out), args.arch, ptx=args.ptx)
    else:
        manifests = [build_suite(Path(args.out), arch=args.arch, ptx=args.ptx)]
    for manifest in manifests:
        print(f"paged-attention suite built: {manifest}")
    return 0


def cmd_bench_paged_run(args: argparse.Namespace) -> int:
    from .bench.paged_attention import run_suite

    run_suite(Path(args.manifest), _output(args), accept_ptx=_accept_ptx(args))
    return 0


def cmd_bench_e2e(args: argparse.Namespace) -> int:
    from .bench.e2e import run_e2e

    libs = {}
    for item in args.lib:
        impl, sep, path = item.partition("=")
        if not sep:
            raise FuselightError(f"--lib {item!r}: expected IMPL=PATH, e.g. baseline=llama-baseline.so")
        libs[impl] = Path(path)
    run_e2e(libs, args.model, _output(args), torch=not args.no_torch, profile=args.profile,
            accept_ptx=_accept_ptx(args))
    return 0


def cmd_bench_mlc_e2e(args: argparse.Namespace) -> int:
    from .bench.mlc_e2e import run_mlc_e2e

    libs = {}
    for item in args.lib:
        key, sep, path = item.partition("=")
        impl, at, case = key.partition("@")
        if not sep or not at or not case:
            raise FuselightError(f"--lib {item!r}: expected IMPL@CASE=PATH, e.g. mlc@llama-3-8b=llama-mlc.so")
        libs[(impl, case)] = Path(path)
    run_mlc_e2e(libs, _output(args), model=args.model, device=args.device, accept_ptx=_accept_ptx(args))
    return 0


def cmd_mlc_compile(args: argparse.Namespace) -> int:
    from .mlc.cli import compile_main

    return compile_main(args.args)


def cmd_explain(args: argparse.Namespace) -> int:
    from .explain import explain, explain_graph, format_text

    if (args.model is None) == (args.graph is None):
        raise FuselightError("explain: give either --model or --graph")
    if args.graph is not None:
        report = explain_graph(args.graph, prompt_len=args.prompt_len)
    else:
        report = explain(_model_config(args.model, args.dtype, args.quantization), prompt_len=args.prompt_len)
    print(json.dumps(report, indent=1) if args.json else format_text(report))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .report import make_report

    out = make_report([Path(p) for p in args.results], Path(args.out_dir) if args.out_dir else None)
    print(f"report written: {out}")
    return 0


def _shape(text: str) -> tuple[int, int]:
    n, sep, k = text.partition("x")
    if not sep or not n.isdigit() or not k.isdigit():
        raise argparse.ArgumentTypeError(f"expected NxK such as 4096x14336, got {text!r}")
    return int(n), int(k)


def cmd_tune_gemm_build(args: argparse.Namespace) -> int:
    from .tune.gemm import build

    print(f"manifest written: {build(Path(args.out), args.arch, args.shapes)}")
    return 0


def cmd_tune_gemm_run(args: argparse.Namespace) -> int:
    from .tune.gemm import run

    result = run(Path(args.manifest), Path(args.output))
    return 1 if result["failures"] else 0


def cmd_tune_gemm_table(args: argparse.Namespace) -> int:
    from .tune.gemm import table

    table(Path(args.results), args.arch, write=args.write)
    return 0


def cmd_tune_gemm_model(args: argparse.Namespace) -> int:
    from .tune.cost_model import gemm_model

    if args.results:
        results = Path(args.results)
    else:
        from .bench.results import default_path
        from .jsonfile import read_json_object

        device = read_json_object(Path(args.data), missing=f"dataset not found: {args.data}").get("device")
        results = default_path(str(device or args.arch), f"tuning-gemm-{args.arch}")
    gemm_model(Path(args.data), args.arch, do_eval=args.eval, write=args.write, results=results)
    return 0


def cmd_audit_pdl(args: argparse.Namespace) -> int:
    from .pdl_audit import audit_library, summary

    ok = True
    for library in args.libraries:
        found = summary(audit_library(Path(library)))
        print(f"{library}: {found['kernels']} kernels, {found['waiting']} wait for the grid before them, "
              f"{len(found['out_of_order'])} touch memory before their wait")
        for bad in found["out_of_order"]:
            print(f"  {bad['kernel']}: wait at instruction {bad['wait_at']}, before it: {'; '.join(bad['memory_before_wait'][:4])}")
        ok = ok and not found["out_of_order"]
    return 0 if ok else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fuselight", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="compile a LLaMA model into a library")
    c.add_argument("--model", required=True, help="preset name (configs/models) or a config.json path")
    c.add_argument("--target", required=True, help="cuda or llvm")
    c.add_argument("--arch", default=None, help="CUDA arch, e.g. sm_90 (cuda only; default sm_90)")
    c.add_argument("--pipeline", default="fuselight", help="baseline or fuselight")
    c.add_argument("--dtype", default=None, help="float16, bfloat16 or float32 (default: the config's)")
    c.add_argument("--quantization", default=None,
                   help="4-bit weights in an MLC-LLM scheme: q4f16_1, q4bf16_1 or q4f16_0 (default: none)")
    c.add_argument("-o", "--output", required=True, help="library path, e.g. llama.so")
    c.add_argument("--no-aot", action="store_true", help="keep CUDA as source (compiled when loaded)")
    c.add_argument("--ptx", action="store_true", help=PTX_HELP)
    c.add_argument("--passes", default=None,
                   help="fuselight pipeline: comma-separated graph passes ('none': no passes; default: fuselight.passes.DEFAULT, less those needing rules left out)")
    c.add_argument("--no-rules", action="store_true", help="fuselight pipeline: DLight's rules only (measure the passes alone)")
    c.add_argument("--no-programmatic-launch", action="store_true",
                   help="fuselight pipeline: launch each kernel only after the one before it has finished (no PDL)")
    c.add_argument("--whole-step-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="fuselight pipeline: one CUDA graph a decode step, KV-cache attention included (the "
                        "capture_whole_step pass; only where the build captures graphs; default: with the default "
                        "passes on a described arch, fuselight.compile.build)")
    c.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="capture the static parts of each function as CUDA graphs (default: on for cuda, as MLC-LLM's O2; "
                        "with fuselight's passes named by --passes on sm_90+, only where the host would set the pace)")
    c.set_defaults(func=cmd_compile)

    d = sub.add_parser("demo", help="tiny LLaMA through both pipelines on the CPU, compared")
    d.add_argument("--model", default="tiny-llama")
    # Half precision by default: that is where the pipelines differ (matmul accumulation).
    d.add_argument("--dtype", default="float16")
    d.add_argument("--prompt-len", type=int, default=13)
    d.add_argument("--decode-steps", type=int, default=8)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="benchmarks: build (build host), run / e2e (GPU host)")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    bb = bsub.add_parser("build", help="compile the kernel suite for the GPU")
    bb.add_argument("out", help="output directory")
    bb.add_argument("--arch", default="sm_90")
    bb.add_argument("--suite", default="full", help="a kernel suite of configs/bench.json (gpu: the GPU test tier's cases)")
    bb.add_argument("--cases", nargs="*", default=None)
    bb.add_argument("--ptx", action="store_true", help=PTX_HELP)
    bb.set_defaults(func=cmd_bench_build)
    br = bsub.add_parser("run", help="run the kernel suite (GPU host)")
    br.add_argument("manifest", help="manifest.json written by 'bench build'")
    br.add_argument("-o", "--output", default=None,
                    help="results JSON (default bench/results/<device>/kernels.json; a partial run updates its points)")
    br.add_argument("--cases", nargs="*", default=None)
    br.add_argument(
        "--sweep", nargs="+", type=int, default=None, help="run these values of each symbolic case's swept dimension"
    )
    br.add_argument("--accept-ptx", action="store_true", help=ACCEPT_PTX_HELP)
    br.set_defaults(func=cmd_bench_run)
    pb = bsub.add_parser("paged-build", help="compile the KV-cache attention kernels, TVM's and ours")
    pb.add_argument("out", help="output directory")
    pb.add_argument("--arch", default="sm_90")
    pb.add_argument("--gpu-tier", action="store_true",
                    help="one suite per layout of the GPU test tier (paged_attention.gpu), into OUT/paged-<layout>/")
    pb.add_argument("--ptx", action="store_true", help=PTX_HELP)
    pb.set_defaults(func=cmd_bench_paged_build)
    pr = bsub.add_parser("paged-run", help="check and time the KV-cache attention kernels (GPU host)")
    pr.add_argument("manifest", help="manifest.json written by 'bench paged-build'")
    pr.add_argument("-o", "--output", default=None, help="results JSON (default bench/results/<device>/paged-attention.json)")
    pr.add_argument("--accept-ptx", action="store_true", help=ACCEPT_PTX_HELP)
    pr.set_defaults(func=cmd_bench_paged_run)

    be = bsub.add_parser("e2e", help="end-to-end LLaMA suite (GPU host)")
    be.add_argument("--model", default="llama-3-8b")
    be.add_argument("--lib", action="append", default=[], help="IMPL=PATH, e.g. baseline=build/llama-baseline.so")
    be.add_argument("--no-torch", action="store_true", help="skip the transformers comparison")
    be.add_argument("--profile", action="store_true",
                    help="also profile each library's decode steps: kernel time and launches by family")
    be.add_argument("-o", "--output", default=None,
                    help="results JSON (default bench/results/<device>/e2e-<model>[-<quantization>].json)")
    be.add_argument("--accept-ptx", action="store_true", help=ACCEPT_PTX_HELP)
    be.set_defaults(func=cmd_bench_e2e)

    bm = bsub.add_parser("mlc-e2e", help="MLC-LLM-compiled models with and without fuselight, compared (GPU host)")
    bm.add_argument("--lib", action="append", default=[],
                    help="IMPL@CASE=PATH: IMPL mlc or mlc+fuselight, CASE a model name (both impls per case)")
    bm.add_argument("--model", default="llama-3-8b", help="the case that is this LLaMA preset: float64 check and timing")
    bm.add_argument("--device", default="cuda", help="cuda, or cpu for llvm libraries")
    bm.add_argument("-o", "--output", default=None,
                    help="results JSON (default bench/results/<device>/mlc-e2e-<model>[-<quantization>].json)")
    bm.add_argument("--accept-ptx", action="store_true", help=ACCEPT_PTX_HELP)
    bm.set_defaults(func=cmd_bench_mlc_e2e)

    m = sub.add_parser("mlc", help="MLC-LLM with fuselight")
    msub = m.add_subparsers(dest="mlc_command", required=True)
    # Everything after 'compile' is forwarded (ours taken out): no option of its own is parsed here.
    mc = msub.add_parser("compile", prefix_chars="+", help="mlc_llm compile with fuselight in MLC's pipeline",
                         description="Arguments of 'mlc_llm compile', plus --fuselight-passes a,b, "
                         "--fuselight-rules fam,..., --fuselight-dump DIR, --no-fuselight (fuselight.mlc.cli).")
    mc.add_argument("args", nargs=argparse.REMAINDER)
    mc.set_defaults(func=cmd_mlc_compile)

    e = sub.add_parser("explain", help="the model's operators with classes and costs (no compile)")
    e.add_argument("--model", default=None, help="preset name (configs/models) or a config.json path")
    e.add_argument("--graph", default=None, help="a transformer layer instead (configs/graphs: bert-encoder, vit-block)")
    e.add_argument("--dtype", default=None, help="float16, bfloat16 or float32 (default: the config's)")
    e.add_argument("--quantization", default=None, help="q4f16_1, q4bf16_1 or q4f16_0 (default: none)")
    e.add_argument("--prompt-len", type=int, default=128, help="length the symbolic dims are evaluated at")
    e.add_argument("--json", action="store_true", help="print JSON instead of tables")
    e.set_defaults(func=cmd_explain)

    t = sub.add_parser("tune", help="measure kernel variants and write the configs the rules read")
    tsub = t.add_subparsers(dest="tune_command", required=True)
    tb = tsub.add_parser("gemm-build", help="compile every GEMM plan for the LLaMA weight shapes")
    tb.add_argument("out", help="output directory")
    tb.add_argument("--arch", default="sm_90")
    tb.add_argument("--shapes", nargs="*", type=_shape, default=None, help="NxK weight shapes (default: the suite's)")
    tb.set_defaults(func=cmd_tune_gemm_build)
    tr = tsub.add_parser("gemm-run", help="check and time every GEMM plan at every M (GPU host)")
    tr.add_argument("manifest", help="manifest.json written by 'tune gemm-build'")
    tr.add_argument("-o", "--output", required=True, help="timings JSON")
    tr.set_defaults(func=cmd_tune_gemm_run)
    tt = tsub.add_parser("gemm-table", help="measured plan ranges from the timings, vs the analytic choice")
    tt.add_argument("results", help="timings JSON written by 'tune gemm-run'")
    tt.add_argument("--arch", default="sm_90")
    tt.add_argument("--write", action="store_true", help="store them in configs/gemm/dispatch.json")
    tt.set_defaults(func=cmd_tune_gemm_table)
    tm = tsub.add_parser("gemm-model", help="train the learned GEMM cost model (xgboost) on measured timings")
    tm.add_argument("data", help="dataset JSON written by 'tune gemm-run'")
    tm.add_argument("--arch", default="sm_90")
    tm.add_argument("--eval", action="store_true", help="leave-one-shape-out evaluation, xgboost vs analytic")
    tm.add_argument("--results", default=None,
                    help="where --eval writes its JSON (default bench/results/<device>/tuning-gemm-<arch>.json)")
    tm.add_argument("--write", action="store_true",
                    help="store the model and the dataset in configs/gemm/ (cost-model-<arch>.json, measured-<arch>.json)")
    tm.set_defaults(func=cmd_tune_gemm_model)

    a = sub.add_parser("audit-pdl", help="SASS check: every waiting kernel touches memory only after its wait (needs cuobjdump)")
    a.add_argument("libraries", nargs="+", help="libraries built by fuselight compile (their .cuda fatbins are read)")
    a.set_defaults(func=cmd_audit_pdl)

    r = sub.add_parser("report", help="one Markdown report and plots over results JSONs (or directories of them)")
    r.add_argument("results", nargs="+", help="results or tuning JSON files, or directories: every JSON in them")
    r.add_argument("-o", "--out-dir", default=None, help="default: report/ in the first directory, or in the first file's")
    r.set_defaults(func=cmd_report)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except FuselightError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
