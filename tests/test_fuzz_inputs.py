"""Property-based fuzzing of config and preset values (issue 19): any value of any type (NaN, +-inf,
huge, negative, strings, lists, nested maps) in any field of a valid preset or config, or given with
--set, makes `tiersep estimate --method analytic` and `tiersep fit` exit with a documented code
(0, 2 bad input, 3 does not fit) and, on failure, a last stderr line `tiersep <command>: error:
<file or option>: ...`; no exception escapes. Derandomized: CI runs the same examples every time."""
import contextlib
import copy
import io
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from tiersep import cli
from tiersep import config as C

REPO = Path(__file__).resolve().parents[1]
EXIT_CODES = {0, 2, 3}
# `tiersep fit: error: /tmp/.../c.yaml: budget_gib: ...` or `tiersep estimate: error: argument --set: ...`
ONE_LINE = re.compile(r"^tiersep (estimate|fit): error: \S.*: \S")
FUZZ = settings(derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _leaves(node, path=()):
    """Every key path in a document: sections, fields and list items."""
    out = [path] if path else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _leaves(value, path + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _leaves(value, path + (i,))
    return out


BASE_PRESET = C.load_preset(str(REPO / "config" / "presets" / "cpu_tiny.yaml")) | {"name": "fz"}
BASE_CONFIG = C.validate({"tiers": ["fz"], "estimate_tiers": [], "budget_gib": 24}, "config.schema.yaml", "fz")
# presets_dir and tiers point at the fuzzed preset; every other config field is fuzzed
PRESET_PATHS = _leaves(BASE_PRESET) + [("audio", "unknown_key"), ("extra",)]
CONFIG_PATHS = [p for p in _leaves(BASE_CONFIG) if p[0] not in ("presets_dir", "tiers")] + [("unknown_key",)]

SPECIAL = [float("nan"), float("inf"), float("-inf"), -1, 0, 1, -0.0, 1e308, 5e-324, 2**31, 2**63 - 1, 2**63,
           10**40, "", "auto", "nan", ".inf", "1e4", "16000.0", "a\nb", True, False, None]
SCALARS = st.one_of(
    st.sampled_from(SPECIAL),
    st.integers(),
    st.integers(min_value=0, max_value=10**6),
    st.builds(lambda k: 2**k, st.integers(0, 70)),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=0, max_value=1),
    st.builds(lambda k: 10.0**k, st.integers(-320, 308)),
    st.text(max_size=12),
)
# numbers a field may well take: the runs that get past validation into the estimate and fit
NUMBERS = st.one_of(
    st.integers(min_value=0, max_value=10**6),
    st.builds(lambda k: 2**k, st.integers(0, 62)),
    st.floats(min_value=0, max_value=1),
    st.builds(lambda k: 10.0**k, st.integers(-30, 30)),
)
VALUES = st.one_of(
    SCALARS,
    st.recursive(SCALARS, lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers()), inner, max_size=4)), max_leaves=8),
)


def _put(doc: dict, path: tuple, value) -> dict:
    doc = copy.deepcopy(doc)
    node = doc
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return doc


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "presets").mkdir()
    return tmp


def _run(folder: Path, command: str, preset: dict, config: dict, sets: list[str], budget: str = "4") -> int:
    """Run one command in process, check the invariants and return its exit code."""
    (folder / "presets" / "fz.yaml").write_text(yaml.safe_dump(preset))
    (folder / "c.yaml").write_text(yaml.safe_dump(_put(config, ("presets_dir",), str(folder / "presets"))))
    out = folder / ("e.json" if command == "estimate" else "f.yaml")
    out.unlink(missing_ok=True)
    argv = [command, "--config", str(folder / "c.yaml"), "--preset", "fz", "--device", "cpu", "--out", str(out)]
    argv += ["--method", "analytic"] if command == "estimate" else ["--budget", budget]
    for text in sets:
        argv += ["--set", text]
    stderr = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
        try:
            code = cli.main(argv)
        except SystemExit as exit_:   # argparse's usage errors
            code = exit_.code
    assert code in EXIT_CODES, stderr.getvalue()
    if currently_in_test_context():
        event(f"{command} exit {code}")   # shown by pytest --hypothesis-show-statistics
    if code == 0:
        assert out.is_file()
    else:
        lines = stderr.getvalue().strip().splitlines()
        assert lines and ONE_LINE.match(lines[-1]), stderr.getvalue()
        assert not out.exists()
    return code


def _set_text(path: tuple, value) -> str:
    """--set section.field=VALUE, the value written as YAML flow text."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    text = text.removesuffix("...").strip()   # PyYAML ends a bare scalar document with '...'
    return ".".join(map(str, path)) + "=" + text


@settings(FUZZ, max_examples=200)
@given(path=st.sampled_from(PRESET_PATHS), value=VALUES)
def test_fuzz_preset_values_estimate(folder, path, value):
    _run(folder, "estimate", _put(BASE_PRESET, path, value), BASE_CONFIG, [])


@settings(FUZZ, max_examples=150)
@given(path=st.sampled_from(CONFIG_PATHS), value=VALUES)
def test_fuzz_config_values_estimate(folder, path, value):
    _run(folder, "estimate", BASE_PRESET, _put(BASE_CONFIG, path, value), [])


@settings(FUZZ, max_examples=150)
@given(path=st.sampled_from([p for p in PRESET_PATHS if len(p) > 1]), value=VALUES)
def test_fuzz_set_values_estimate(folder, path, value):
    _run(folder, "estimate", BASE_PRESET, BASE_CONFIG, [_set_text(path, value)])


@settings(FUZZ, max_examples=80)
@given(where=st.sampled_from(["preset", "config", "set"]), preset_path=st.sampled_from(PRESET_PATHS),
       config_path=st.sampled_from(CONFIG_PATHS), value=st.one_of(NUMBERS, VALUES), budget=st.sampled_from(["4", "24", "0.05"]))
def test_fuzz_fit(folder, where, preset_path, config_path, value, budget):
    preset, config, sets = BASE_PRESET, BASE_CONFIG, []
    if where == "preset":
        preset = _put(preset, preset_path, value)
    elif where == "config":
        config = _put(config, config_path, value)
    elif len(preset_path) > 1:
        sets = [_set_text(preset_path, value)]
    _run(folder, "fit", preset, config, sets, budget)


def test_the_base_documents_reach_every_outcome(folder):
    """What the fuzzing varies runs as is (0), and each failure code is reached and checked."""
    assert _run(folder, "estimate", BASE_PRESET, BASE_CONFIG, []) == 0
    assert _run(folder, "fit", BASE_PRESET, BASE_CONFIG, [], budget="4") == 0
    assert _run(folder, "fit", BASE_PRESET, BASE_CONFIG, [], budget="0.001") == 3
    assert _run(folder, "estimate", BASE_PRESET, BASE_CONFIG, ["train.lr=.nan"]) == 2
    assert _run(folder, "fit", BASE_PRESET, BASE_CONFIG, [], budget="nan") == 2


def test_an_escaping_exception_fails_the_check(folder, monkeypatch):
    def broken(args, cfg):
        raise TypeError("randn(): argument 'size' failed to unpack")

    monkeypatch.setattr(cli, "cmd_estimate", broken)
    with pytest.raises(TypeError):
        _run(folder, "estimate", BASE_PRESET, BASE_CONFIG, [])
