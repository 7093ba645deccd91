"""Strict values and one-line failures (issue 19). CASES (bad inputs through the real CLI) are rows of
the one table in tests/test_bad_inputs.py, which runs them with the table's invariants; the tests
here check the rules themselves in-process."""
import sys
from pathlib import Path

import pytest

from tiersep import cli
from tiersep import config as C

REPO = Path(__file__).resolve().parents[1]
TIERSEP = str(Path(sys.executable).parent / "tiersep")

# Pure-text and binary inputs, written into the test's tmp folder by name.
PRESET_16000_0 = """name: float_segment
audio: {sample_rate: 8000, segment_samples: 16000.0, n_fft: 256, hop: 128}
model: {n_layers: 1, emb_dim: 16, attention_dim: 16, n_heads: 1, ffn_hidden: 32, norm_groups: 1}
train: {steps: 10}
"""
BOMB_EXPANDED = ('a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'   # 81 aliases, 9^9 nodes
                 + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n"
                           for i in range(8)))
BOMB_ALIASES = "a: &a [1]\nb: [" + ", ".join(["*a"] * 200) + "]\n"
SECRET = "s3cr3t-" + "x" * 80
TEXT_FILE = "".join(f"line{i}_{SECRET}: {i}\n" for i in range(20))   # any text file that parses as YAML
FILES = {
    "nan_budget.yaml": "budget_gib: .nan\n",
    "inf_budget.yaml": "budget_gib: .inf\n",
    "nan_margin.yaml": "estimate: {safety_margin: .nan}\n",
    "neg_inf_overlap.yaml": "evaluate: {overlap: -.inf}\n",
    "nan_in_sweep.yaml": "sweep: {presets: [cpu_tiny], grid: {train.lr: [0.001, .nan]}}\n",
    "float_segment.yaml": PRESET_16000_0,
    "exp_segment.yaml": PRESET_16000_0.replace("16000.0", "1.6e4"),
    "bomb.yaml": BOMB_EXPANDED,
    "aliases.yaml": BOMB_ALIASES,
    "recursive.yaml": "a: &a [1, *a]\n",
    "deep.yaml": "a: " + "[" * 200 + "]" * 200 + "\n",
    "big.yaml": "# " + "x" * (1 << 20) + "\n",
    "big_preset.yaml": PRESET_16000_0 + "# " + "x" * (1 << 20) + "\n",
    "notes.yaml": TEXT_FILE,
}
BINARY = {
    "garbage.yaml": bytes(range(128, 256)) * 8,   # not UTF-8
    "nul.yaml": b"budget_gib: 1\x00\x01\x02\n",   # UTF-8, but control characters
    "unclosed.yaml": b"budget_gib: 30\nseparate:\n  inputs: [a, b\n  tiers: x\n",   # a YAML syntax error
}


def estimate(*extra):
    return ["estimate", "--preset", "cpu_tiny", "--method", "analytic", "--device", "cpu",
            "--out", "{tmp}/e.json", *extra]


def fit(*extra):
    return ["fit", "--preset", "cpu_tiny", "--device", "cpu", "--out", "{tmp}/f.yaml", *extra]


# (id, argv with {tmp} for the test's folder, exit code, what the last stderr line must contain)
CASES = [
    ("config-nan-budget", estimate("--config", "{tmp}/nan_budget.yaml"), 2, ["nan_budget.yaml", "budget_gib", "finite"]),
    ("config-inf-budget", estimate("--config", "{tmp}/inf_budget.yaml"), 2, ["inf_budget.yaml", "budget_gib", "finite"]),
    ("config-nan-margin", estimate("--config", "{tmp}/nan_margin.yaml"), 2, ["nan_margin.yaml", "estimate.safety_margin"]),
    ("config-neg-inf-overlap", estimate("--config", "{tmp}/neg_inf_overlap.yaml"), 2, ["evaluate.overlap", "finite"]),
    ("config-nan-in-sweep-grid", estimate("--config", "{tmp}/nan_in_sweep.yaml"), 2, ["sweep.grid.train.lr[1]"]),
    ("set-lr-nan", estimate("--set", "train.lr=.nan"), 2, ["--set", "train.lr", "finite"]),
    ("set-dropout-nan", estimate("--set", "model.dropout=.nan"), 2, ["--set", "model.dropout", "finite"]),
    ("set-lr-inf", estimate("--set", "train.lr=.inf"), 2, ["--set", "train.lr", "finite"]),
    ("set-betas-neg-inf", estimate("--set", "train.betas=[0.9, -.inf]"), 2, ["train.betas[1]", "finite"]),
    ("set-segment-float", estimate("--set", "audio.segment_samples=16000.0"), 2,
     ["audio.segment_samples", "16000.0 is not of type 'integer'"]),
    ("set-segment-exponent", estimate("--set", "audio.segment_samples=1.6e4"), 2,
     ["audio.segment_samples", "16000.0 is not of type 'integer'"]),
    ("set-batch-bool", estimate("--set", "train.batch_size=true"), 2, ["train.batch_size", "not of type 'integer'"]),
    ("set-key-with-a-line-break", estimate("--set", 'model.dropout={"a\\x1db": .nan}'), 2,
     ["model.dropout.a\\x1db", "finite"]),
    ("set-not-yaml", estimate("--set", "train.lr=[1,"), 2, ["--set", "train.lr", "not a YAML value"]),
    ("preset-segment-float", ["estimate", "--preset", "{tmp}/float_segment.yaml", "--method", "analytic",
                              "--device", "cpu", "--out", "{tmp}/e.json"], 2,
     ["float_segment.yaml", "audio.segment_samples", "16000.0 is not of type 'integer'"]),
    ("preset-segment-exponent", ["fit", "--preset", "{tmp}/exp_segment.yaml", "--budget", "1",
                                 "--out", "{tmp}/f.yaml"], 2,
     ["exp_segment.yaml", "audio.segment_samples", "16000.0 is not of type 'integer'"]),
    ("config-binary", estimate("--config", "{tmp}/garbage.yaml"), 2, ["garbage.yaml", "not a YAML text file"]),
    ("config-control-chars", estimate("--config", "{tmp}/nul.yaml"), 2, ["nul.yaml", "not a YAML text file"]),
    ("config-syntax-error", estimate("--config", "{tmp}/unclosed.yaml"), 2,   # file:line:column, as an editor
     ["unclosed.yaml:4:8: not valid YAML", "expected ',' or ']'"]),
    ("config-check-syntax-error", ["config", "--check", "{tmp}/unclosed.yaml"], 2,   # what Snakemake cannot say
     ["unclosed.yaml:4:8: not valid YAML"]),
    ("preset-binary", ["estimate", "--preset", "{tmp}/garbage.yaml", "--out", "{tmp}/e.json"], 2,
     ["garbage.yaml", "not a YAML text file"]),
    ("config-alias-bomb", estimate("--config", "{tmp}/bomb.yaml"), 2, ["bomb.yaml", "aliases are expanded"]),
    ("config-many-aliases", estimate("--config", "{tmp}/aliases.yaml"), 2, ["aliases.yaml", "more than 100 YAML aliases"]),
    ("config-recursive-alias", estimate("--config", "{tmp}/recursive.yaml"), 2, ["recursive.yaml", "recursive"]),
    ("config-deep-nesting", estimate("--config", "{tmp}/deep.yaml"), 2, ["deep.yaml", "nested deeper than"]),
    ("config-oversized", estimate("--config", "{tmp}/big.yaml"), 2, ["big.yaml", "1 MiB"]),
    ("preset-oversized", ["estimate", "--preset", "{tmp}/big_preset.yaml", "--out", "{tmp}/e.json"], 2,
     ["big_preset.yaml", "1 MiB"]),
    ("config-is-a-directory", estimate("--config", "{tmp}/folder.yaml"), 2, ["folder.yaml", "Is a directory"]),
    ("preset-not-yaml-path", ["estimate", "--preset", "/etc/passwd", "--out", "{tmp}/e.json"], 2,
     ["/etc/passwd", "must be a .yaml or .yml file"]),
    ("preset-text-file", ["estimate", "--preset", "{tmp}/notes.yaml", "--out", "{tmp}/e.json"], 2,
     ["notes.yaml", "unknown key", "and 15 more"]),
    *[(f"{cmd}-budget-{value}", (estimate if cmd == "estimate" else fit)("--budget", value), 2,
       ["argument --budget", "out of range"])
      for cmd in ("estimate", "fit") for value in ("nan", "inf", "-1", "0")],
    ("fit-budget-text", fit("--budget", "lots"), 2, ["argument --budget", "not a finite number"]),
    *[(f"prepare-sample-rate-{rate}", ["prepare", "--out", "{tmp}/prepared", "--sample-rate", rate], 2,
       ["argument --sample-rate", "out of range", "audio.sample_rate"]) for rate in ("0", "1", "-8000")],
    ("separate-seed-beyond-64-bits", ["separate", "--model", "{tmp}/m.pt", "--out", "{tmp}/s", "--seed", str(2**64),
                                      "{tmp}/song.wav"], 2, ["argument --seed", "64-bit"]),
    ("train-attempt-0", ["train", "--preset", "cpu_tiny", "--data", "{tmp}/d", "--out", "{tmp}/t",
                         "--attempt", "0"], 2, ["argument --attempt", ">= 1"]),
    ("fit-nothing-fits", fit("--budget", "0.001"), 3, ["nothing fits", "cpu_tiny"]),
    ("estimate-measure-cuda-without-gpu", ["estimate", "--preset", "cpu_tiny", "--method", "measure",
                                           "--device", "cuda", "--out", "{tmp}/e.json"], 2,
     ["--method measure", "needs a GPU"]),
]


def test_unknown_keys_are_few_and_short():
    err = pytest.raises(C.ConfigError, C.validate, {f"k{i}_{'y' * 100}": i for i in range(9)} | {"name": "x"},
                        "preset.schema.yaml", "p.yaml").value
    message = str(err)
    assert message.count("'k") == 5 and "and 4 more" in message and "y" * 60 not in message


def test_integers_stay_integers():
    """ints (and big ints) are integers; floats and bools are not, in any integer field."""
    preset = C.load_preset("cpu_tiny")
    for value, ok in ((16000, True), (2**40, True), (16000.0, False), (True, False)):
        trial = C.set_field(preset, "audio.segment_samples", value)
        if ok:
            assert C.validate(trial, "preset.schema.yaml", "p")["audio"]["segment_samples"] == value
        else:
            with pytest.raises(C.ConfigError, match="audio.segment_samples: .* is not of type 'integer'"):
                C.validate(trial, "preset.schema.yaml", "p")


@pytest.mark.parametrize("path", sorted((REPO / "tests" / "configs" / "presets").glob("*.yaml")), ids=lambda p: p.name)
def test_test_presets_still_validate(path):
    assert C.load_preset(str(path))["name"] == path.stem


def test_test_config_still_validates(monkeypatch):
    monkeypatch.chdir(REPO)   # presets_dir is relative to the checkout
    files = ["config/config.yaml", "tests/configs/tiny.yaml", "tests/configs/with_refused_tier.yaml"]
    merged = C.validate_config(C.read_config_files(files), files)
    assert merged["tiers"] == ["test_tiny", "test_gpu_sized"]


def test_set_values_are_bounded_yaml():
    with pytest.raises(C.YamlLimitError, match="aliases"):
        C.load_yaml("[&a 1, " + ", ".join(["*a"] * 101) + "]")
    with pytest.raises(C.YamlLimitError, match="limit"):
        C.load_yaml("x" * (C.MAX_YAML_BYTES + 1))


def test_tiny_positive_budget_is_not_zero_bytes():
    cfg = {"budget_gib": 1e-300}
    assert C.budget_bytes(cfg) == 1


# main()'s mapping of what a command can meet, in process (the commands are replaced).
def _run_main(monkeypatch, capsys, error, argv):
    def command(args, cfg):
        raise error

    monkeypatch.setattr(cli, "cmd_report", command)
    code = cli.main(["report", *argv])
    return code, capsys.readouterr().err


def test_oserror_on_a_named_input_is_one_line(monkeypatch, capsys, tmp_path):
    results = tmp_path / "results"
    error = PermissionError(13, "Permission denied", str(results / "train" / "x" / "run.json"))
    code, err = _run_main(monkeypatch, capsys, error, ["--results", str(results), "--out", str(tmp_path / "r")])
    assert code == 2
    assert err.strip() == f"tiersep report: error: {results}/train/x/run.json: cannot read it (Permission denied)"


def test_oserror_elsewhere_is_a_bug_with_its_traceback(monkeypatch, capsys, tmp_path):
    error = FileNotFoundError(2, "No such file or directory", "/nowhere/at/all")
    with pytest.raises(FileNotFoundError):
        _run_main(monkeypatch, capsys, error, ["--results", str(tmp_path), "--out", str(tmp_path / "r")])


def test_other_exceptions_keep_their_traceback(monkeypatch, capsys, tmp_path):
    with pytest.raises(ZeroDivisionError):
        _run_main(monkeypatch, capsys, ZeroDivisionError("a bug"), ["--out", str(tmp_path / "r")])


def test_exit_code_of_a_config_error_subclass(monkeypatch, capsys, tmp_path):
    class Busy(C.ConfigError):
        exit_code = 5

    code, err = _run_main(monkeypatch, capsys, Busy("results/x: busy (pid 1 on host)\nsecond"), ["--out", str(tmp_path)])
    assert code == 5 and err.count("\n") == 1 and "busy (pid 1 on host)\\nsecond" in err
    code, _ = _run_main(monkeypatch, capsys, C.ConfigError("plain"), ["--out", str(tmp_path)])
    assert code == 2


def test_keyboard_interrupt_is_one_line_and_130(monkeypatch, capsys, tmp_path):
    code, err = _run_main(monkeypatch, capsys, KeyboardInterrupt(), ["--out", str(tmp_path)])
    assert code == 130 and err == "tiersep report: interrupted\n"
