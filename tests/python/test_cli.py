"""Bad input reaches the user as one line naming the problem, exit code 2, no traceback."""

import json
import subprocess
import sys

import pytest

from fuselight.cli import main


def _fails(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def test_unknown_preset(capsys):
    _fails(capsys, ["compile", "--model", "llama-99b", "--target", "llvm", "-o", "x.so"], "llama-99b", "tiny-llama")


def test_malformed_config_json(capsys, tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{ not json")
    _fails(capsys, ["compile", "--model", str(bad), "--target", "llvm", "-o", "x.so"], "not valid JSON")


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("hidden_act", "gelu", "hidden_act"),
        ("model_type", "mistral", "model_type"),
        ("num_key_value_heads", 3, "num_key_value_heads"),
        ("hidden_size", "4096", "hidden_size"),
        ("vocab_size", -5, "vocab_size"),
        ("torch_dtype", "int8", "torch_dtype"),
        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling"),
    ],
)
def test_unsupported_config_field(capsys, tmp_path, field, value, needle):
    from fuselight.paths import config_dir

    raw = json.loads((config_dir() / "models" / "tiny-llama.json").read_text())
    raw[field] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    _fails(capsys, ["compile", "--model", str(path), "--target", "llvm", "-o", "x.so"], needle)


def test_missing_config_field(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    _fails(capsys, ["compile", "--model", str(path), "--target", "llvm", "-o", "x.so"], "missing field")


@pytest.mark.parametrize(
    "target,arch,needle",
    [("rocm", None, "unsupported target 'rocm'"), ("cuda", "sm_70", "sm_70"), ("cuda", "hopper", "hopper"), ("llvm", "sm_90", "cuda targets only")],
)
def test_bad_target_or_arch(capsys, target, arch, needle):
    argv = ["compile", "--model", "tiny-llama", "--target", target, "-o", "x.so"]
    if arch:
        argv += ["--arch", arch]
    _fails(capsys, argv, needle)


def test_ptx_needs_a_cuda_target(capsys):
    _fails(capsys, ["compile", "--model", "tiny-llama", "--target", "llvm", "--ptx", "-o", "x.so"],
           "--ptx applies to cuda targets only")


def test_unsupported_dtype(capsys):
    _fails(capsys, ["compile", "--model", "tiny-llama", "--target", "llvm", "--dtype", "int4", "-o", "x.so"], "int4")


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--quantization", "q3f16_1"], "unsupported quantization 'q3f16_1'"),
        # tiny-llama's intermediate size (344) is not a whole number of 32-element groups
        (["--quantization", "q4f16_1"], "mlp.down_proj.weight: q4f16_1: a weight of shape [128, 344]"),
        (["--quantization", "q4bf16_1", "--dtype", "float16"], "q4bf16_1 computes in bfloat16"),
    ],
)
def test_bad_quantization(capsys, tmp_path, extra, needle):
    argv = ["compile", "--model", "tiny-llama", "--target", "llvm", *extra, "-o", str(tmp_path / "x.so")]
    _fails(capsys, argv, needle)
    assert not (tmp_path / "x.so").exists()


def test_bad_pipeline(capsys, tmp_path):
    _fails(capsys, ["compile", "--model", "tiny-llama", "--target", "llvm", "--pipeline", "fast", "-o", str(tmp_path / "x.so")], "fast")


def test_bad_pass_options(capsys, tmp_path):
    out = str(tmp_path / "x.so")
    _fails(capsys, ["compile", "--model", "tiny-llama", "--target", "llvm", "--passes", "fuse_attention,nosuch", "-o", out],
           "nosuch", "fuse_attention")
    _fails(capsys, ["compile", "--model", "tiny-llama", "--target", "llvm", "--pipeline", "baseline", "--no-rules", "-o", out],
           "baseline")


def test_passes_alone_recorded_in_the_metadata(capsys, tmp_path):
    """The passes without our rules (how the passes are measured by themselves), as the sidecar says."""
    out = tmp_path / "x.so"
    argv = ["compile", "--model", "tiny-llama", "--target", "llvm", "--passes", "property_rewrite,accumulate_matmul_fp32",
            "--no-rules", "--no-programmatic-launch", "-o", str(out)]
    assert main(argv) == 0
    meta = json.loads((tmp_path / "x.so.json").read_text())
    assert meta["fuselight"] == {"passes": ["property_rewrite", "accumulate_matmul_fp32"], "rules": [],
                                 "programmatic_launch": False}


def test_subprocess_exit_code_and_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "fuselight", "compile", "--model", "nope", "--target", "llvm", "-o", "x.so"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("error: unknown model preset 'nope'")


def test_import_fuselight_imports_no_tvm():
    code = "import sys, fuselight, fuselight.config, fuselight.target, fuselight.cli; print(any(m == 'tvm' or m.startswith('tvm.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_whole_step_graph_adds_or_leaves_out_its_pass(monkeypatch, capsys, tmp_path):
    from fuselight import compile as fc
    from fuselight.passes import DEFAULT

    seen = []

    def fake_build(cfg, spec, pipeline, *, options=None, cuda_graph=None):
        seen.append(options.passes)
        raise fc.FuselightError("stop")

    monkeypatch.setattr(fc, "build", fake_build)
    base = ["compile", "--model", "tiny-llama", "--target", "cuda", "--whole-step-graph", "-o", str(tmp_path / "x.so")]
    _fails(capsys, base, "stop")
    _fails(capsys, [*base, "--passes", "paged_attention,fuse_rope_append"], "stop")
    # --no-whole-step-graph names the passes without it, so the build's rule cannot add it
    _fails(capsys, [*base[:-3], "--no-whole-step-graph", "-o", str(tmp_path / "x.so")], "stop")
    assert seen == [(*DEFAULT, fc.WHOLE_STEP_PASS), ("paged_attention", "fuse_rope_append", fc.WHOLE_STEP_PASS), DEFAULT]
