"""Config and preset validation: defaults from the schema, one-line errors naming file and key."""
import json
from pathlib import Path

import pytest
import yaml

from tiersep import config as C

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path, data, name="config.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def base_config(tmp_path):
    return {"presets_dir": str(REPO / "config" / "presets"), "tiers": ["cpu_tiny"], "estimate_tiers": []}


def test_default_config_loads_and_fills_defaults():
    cfg = C.load_config(REPO / "config" / "config.yaml")
    assert cfg["data"]["source"] == "synthetic"
    assert cfg["evaluate"]["max_tracks"] is None  # filled from the schema
    assert cfg["estimate"]["method"] == "trace"


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "config" / "presets").glob("*.yaml")))
def test_every_shipped_preset_validates(name):
    preset = C.load_preset(name, {"presets_dir": str(REPO / "config" / "presets")})
    assert preset["name"] == name
    assert preset["train"]["loss"]["time_l1"] == 1.0  # nested default filled


def test_seed_presets_match_the_design():
    """The five seed tiers of DESIGN.md, field by field."""
    table = {  # segment, n_fft, hop, layers, emb, heads, ffn, batch, accum, precision, groups
        "ultra_safe": (132300, 2048, 512, 4, 96, 4, 384, 1, 4, "bf16", 4),
        "small": (88200, 1024, 256, 3, 48, 4, 192, 1, 1, "bf16", 4),
        "memory_optimized": (220500, 2048, 512, 6, 128, 8, 512, 1, 1, "bf16", 8),
        "large": (441000, 4096, 1024, 8, 192, 12, 768, 1, 8, "fp32", 4),
        "xlarge": (661500, 4096, 1024, 12, 256, 16, 1024, 8, 2, "bf16", 8),
    }
    for name, want in table.items():
        p = C.load_preset(name, {"presets_dir": str(REPO / "config" / "presets")})
        a, m, t = p["audio"], p["model"], p["train"]
        got = (a["segment_samples"], a["n_fft"], a["hop"], m["n_layers"], m["emb_dim"], m["n_heads"],
               m["ffn_hidden"], t["batch_size"], t["grad_accum"], t["precision"], m["norm_groups"])
        assert got == want, name
        assert (m["conv_kernel"], m["conv_stride"], m["dropout"]) == (4, 1, 0.1)


@pytest.mark.parametrize("patch, expected", [
    ({"tiers": "cpu_tiny"}, "tiers: 'cpu_tiny' is not of type 'array'"),
    ({"budget_gib": -3}, "budget_gib:"),
    ({"evaluate": {"overlap": 0.9}}, "evaluate.overlap: 0.9 is greater than the maximum of 0.75"),
    ({"evaluate": {"chunk": 3}}, "evaluate: unknown key 'chunk'"),
    ({"colour": "red"}, "(top level): unknown key 'colour'"),
    ({"data": {"source": "youtube"}}, "data.source: 'youtube' is not one of"),
    ({"data": {"source": "musdb18hq"}}, "data.root: required when data.source is musdb18hq"),
    ({"tiers": ["nope"]}, "preset 'nope' not found"),
])
def test_bad_config_gives_one_line_error_naming_file_and_key(tmp_path, patch, expected):
    path = write(tmp_path, C.deep_merge(base_config(tmp_path), patch))
    with pytest.raises(C.ConfigError) as err:
        C.load_config(path)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(str(path) if "preset" not in expected else "")
    assert expected in message


def test_bad_preset_names_preset_file_and_field(tmp_path):
    preset = yaml.safe_load((REPO / "config/presets/cpu_tiny.yaml").read_text())
    preset["model"]["n_heads"] = 3  # 16 is not divisible by 3
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(preset))
    with pytest.raises(C.ConfigError, match=r"bad.yaml: model.attention_dim: 16 is not divisible by model.n_heads 3"):
        C.load_preset(str(tmp_path / "bad.yaml"))
    preset["model"]["n_heads"] = 2
    preset["train"]["precision"] = "fp8"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(preset))
    with pytest.raises(C.ConfigError, match=r"bad.yaml: train.precision: 'fp8' is not one of \['fp32', 'bf16', 'fp16', 'auto'\]"):
        C.load_preset(str(tmp_path / "bad.yaml"))


def test_set_field_and_budget():
    preset = C.load_preset("cpu_tiny", {"presets_dir": str(REPO / "config" / "presets")})
    changed = C.set_field(preset, "train.lr", 0.1)
    assert changed["train"]["lr"] == 0.1 and preset["train"]["lr"] != 0.1
    assert C.configured_budget_bytes({"budget_gib": 24}) == 24 * 2**30
    assert C.configured_budget_bytes({"budget_gib": 1}, override_gib=2.5) == int(2.5 * 2**30)
    # auto is the free memory of the train job's own GPU, read there: nothing to say before
    assert C.configured_budget_bytes({"budget_gib": "auto"}) is None
    assert C.configured_budget_bytes({"budget_gib": "auto"}, override_gib=3) == 3 * 2**30


# ---------------------------------------------------------------------------------------------
# YAML 1.2 numbers: PyYAML (YAML 1.1) reads 1e-4 without a dot as a string
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, value", [("1e-4", 1e-4), ("5E-4", 5e-4), ("1.0e-3", 1e-3), (".5", 0.5),
                                         ("-2e+3", -2000.0), ("4e-3", 4e-3), ("1e5", 1e5)])
def test_yaml_reads_exponent_floats(text, value):
    loaded = C.load_yaml(f"x: {text}")["x"]
    assert isinstance(loaded, float) and loaded == value


@pytest.mark.parametrize("text, value", [("3", 3), ("0x10", 16), ("true", True), ("null", None),
                                         ("'1e-4'", "1e-4"), ("a1e5", "a1e5"), ("1.5", 1.5), ("auto", "auto")])
def test_yaml_keeps_other_scalars(text, value):
    loaded = C.load_yaml(f"x: {text}")["x"]
    assert loaded == value and type(loaded) is type(value)


def test_exponent_lr_in_a_preset(tmp_path):
    text = (REPO / "config" / "presets" / "cpu_tiny.yaml").read_text().replace("lr: 5.0e-3", "lr: 4e-3")
    assert "lr: 4e-3" in text
    (tmp_path / "mine.yaml").write_text(text)
    assert C.load_preset(str(tmp_path / "mine.yaml"))["train"]["lr"] == 4e-3


def test_exponent_lr_through_set():
    from tiersep import cli

    args = cli.build_parser().parse_args(["estimate", "--preset", "cpu_tiny", "--out", "x.json",
                                          "--set", "train.lr=4e-3", "--set", "train.weight_decay=1E-2"])
    cfg = {"presets_dir": str(REPO / "config" / "presets")}
    preset = cli.resolve_preset("cpu_tiny", cfg, args.set)
    assert preset["train"]["lr"] == 4e-3 and preset["train"]["weight_decay"] == 0.01


SWEEP_CONFIG = """\
presets_dir: {presets}
tiers: [cpu_tiny]
estimate_tiers: []
budget_gib: 2e1
sweep:
  presets: [cpu_tiny]
  grid: {{train.lr: [1e-4, 5E-4]}}
"""


def test_exponent_values_in_a_sweep_grid(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(SWEEP_CONFIG.format(presets=REPO / "config" / "presets"))
    cfg = C.load_config(path)
    assert cfg["budget_gib"] == 20.0
    # the sweep is read as a grid search (config.sweep_as_search): its values are floats there
    assert cfg["search"]["space"]["train.lr"]["choices"] == [1e-4, 5e-4]


def test_snakemake_reads_config_files_as_tiersep_does(tmp_path):
    """Snakemake's own loader reads 1e-4 as a string; the workflow reads its config files again
    through tiersep (read_config_files), so the files and --config give what tiersep gives."""
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("budget_gib: 1e1\nsweep: {presets: [cpu_tiny], grid: {train.lr: [1e-3]}}\n")
    second.write_text("sweep: {presets: [cpu_tiny], grid: {train.lr: [1e-4, 2e-4]}}\n")
    assert yaml.load(second.read_text(), Loader=yaml.FullLoader)["sweep"]["grid"]["train.lr"] == ["1e-4", "2e-4"]
    merged = C.read_config_files([tmp_path / "missing.yaml", first, second], {"tiers": ["cpu_tiny"]})
    assert merged == {"budget_gib": 10.0, "tiers": ["cpu_tiny"],
                      "sweep": {"presets": ["cpu_tiny"], "grid": {"train.lr": [1e-4, 2e-4]}}}


@pytest.mark.slow  # one real snakemake dry run (its start-up imports tiersep and torch)
def test_snakemake_sweep_grid_with_exponent_values(tmp_path):
    """`snakemake -n --configfile` with 1e-4 values in a sweep grid: the `search` target plans the
    sweep's one job (the search), and the merged config every job reads holds it as a grid search
    with float values, no sweep left beside it."""
    from conftest import copy_workflow, run_snakemake

    wf = copy_workflow(tmp_path / "wf")
    cfg = yaml.safe_load((REPO / "tests" / "configs" / "tiny.yaml").read_text())
    cfg.pop("budget_gib")
    text = yaml.safe_dump({**cfg, "estimate_tiers": []}) + (
        "budget_gib: 2e1\nsweep: {presets: [test_tiny], grid: {train.lr: [1e-4, 5E-4]}}\n")
    (wf / "sweep.yaml").write_text(text)
    out = run_snakemake(wf, "search", "-n", "--cores", "1", "--configfile", "sweep.yaml").stdout
    assert "results/search/sweep/trials.csv" in out, out[-3000:]
    merged = json.loads((wf / ".snakemake" / "tiersep" / "merged-config.json").read_text())
    assert merged["sweep"] is None and merged["search"]["sampler"] == "grid"
    assert merged["search"]["space"] == {"train.lr": {"choices": [1e-4, 5e-4], "log": False, "step": None}}
