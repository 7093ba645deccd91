"""Bad search spaces end in one line naming the key (exit 2) before any trial: Hypothesis over
space definitions through the real CLI entry point, and one real `tiersep search` process."""
from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_search_support import env, search_workspace, write_search_config
from test_train_support import REPO
from tiersep import cli
from tiersep.search.space import parse_space

GOOD = {"train.lr": {"low": 1.0e-4, "high": 1.0e-2, "log": True}, "model.emb_dim": {"choices": [16, 32]}}


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return search_workspace(tmp_path_factory.mktemp("search_space"))


numbers = st.integers(-1000, 1000)
unknown_field = st.sampled_from(["train.lrr", "model.no_such_field", "audio.nfft", "train.augment.nope"]).map(
    lambda key: (key, {"low": 1, "high": 2}))
low_above_high = st.tuples(numbers, st.integers(1, 500)).map(
    lambda t: ("train.seed", {"low": t[0] + t[1], "high": t[0]}))
log_not_positive = st.tuples(st.floats(-10, 0), st.floats(0.5, 10)).map(
    lambda t: ("train.lr", {"low": t[0], "high": t[1], "log": True}))
empty_choices = st.sampled_from(["model.emb_dim", "train.lr", "model.attention_backend"]).map(
    lambda key: (key, {"choices": []}))
step_does_not_fit = st.tuples(st.integers(0, 100), st.integers(2, 20), st.integers(1, 10), st.data()).map(
    lambda t: ("train.seed", {"low": t[0], "high": t[0] + t[1] * t[2] + 1 + (t[0] % (t[1] - 1)), "step": t[1]}))
no_range = st.sampled_from([{"low": 1}, {"high": 2}, {}, {"log": True}]).map(lambda spec: ("train.seed", spec))
both = st.just(("train.seed", {"low": 1, "high": 3, "choices": [1, 2]}))
schema_refuses = st.sampled_from([("train.lr", {"low": -1.0, "high": 1.0}),
                                  ("model.n_layers", {"low": 0, "high": 3}),
                                  ("model.attention_backend", {"choices": ["auto", "warp-drive"]})])
float_on_int = st.just(("model.n_layers", {"low": 1.0, "high": 3.5}))
bad_key_pattern = st.sampled_from(["lr", "optimizer.lr", "Train.lr", "train."]).map(
    lambda key: (key, {"low": 1, "high": 2}))
BAD = st.one_of(unknown_field, low_above_high, log_not_positive, empty_choices, step_does_not_fit, no_range,
                both, schema_refuses, float_on_int, bad_key_pattern)


def run_cli(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(argv)
    return code, err.getvalue()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=BAD, good_first=st.booleans())
def test_every_bad_space_is_one_line_naming_the_key_and_no_trial_starts(ws, bad, good_first):
    key, spec = bad
    others = {k: v for k, v in GOOD.items() if k != key}
    space = {**others, key: spec} if good_first else {key: spec, **others}
    config = write_search_config(ws, "bad", trials=3, space=space)
    code, err = run_cli(["search", "--config", str(config)])
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("tiersep search: error: "), err
    assert key in err or key.rstrip(".") in err, err
    assert not (ws["root"] / "results-bad" / "search").exists()   # no study, no trial folder


def test_a_bad_space_in_a_real_process_is_one_line(ws):
    config = write_search_config(ws, "bad_process", space={"train.lr": {"low": 0.1, "high": 0.01}})
    done = subprocess.run([sys.executable, "-m", "tiersep.cli", "search", "--config", str(config)],
                          capture_output=True, text=True, cwd=REPO, env=env(), timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"tiersep search: error: {config}: search.space.train.lr: low 0.1 is above high 0.01"]
    assert not (ws["root"] / "results-bad_process").exists()


def test_good_space_gives_optuna_distributions(ws):
    from tiersep import config as C

    cfg = C.load_config(write_search_config(ws, "good", space={
        **GOOD, "train.seed": {"low": 0, "high": 10, "step": 5}, "train.clip": {"low": 1.0, "high": 2.0, "step": 0.5}}))
    base = C.load_preset(cfg["search"]["preset"], cfg)
    dims = parse_space(cfg["search"], base, "x")
    assert dims["train.lr"].distribution().log and dims["train.seed"].kind == "int"
    assert dims["train.seed"].grid_values() == [0, 5, 10]
    assert dims["train.clip"].grid_values() == [1.0, 1.5, 2.0]
    assert dims["model.emb_dim"].distribution().choices == (16, 32)


def test_cli_flags_are_checked(ws):
    config = write_search_config(ws, "flags", space=GOOD)
    for flags in (["--trials", "0"], ["--parallel", "-1"], ["--study", "../up"]):
        done = subprocess.run([sys.executable, "-m", "tiersep.cli", "search", "--config", str(config), *flags],
                              capture_output=True, text=True, cwd=REPO, env=env(), timeout=300)
        assert done.returncode == 2 and "tiersep search: error: argument" in done.stderr, done.stderr
    assert yaml.safe_load(config.read_text())["search"]["space"] == GOOD
