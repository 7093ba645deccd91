"""Our SDR against the real museval, our SI-SDR against torchmetrics, and museval's edge cases."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torchmetrics.functional.audio import scale_invariant_signal_distortion_ratio as tm_si_sdr

from tiersep.evaluate import metrics

museval = pytest.importorskip("museval")

RATE = 8000
# museval's cost is mostly solving (n*C*512)^2 systems, whatever the rate: 2 sources, mono where
# stereo is not the point, keep each call well under a second.


def make_sources(n=2, channels=1, seconds=3.4, noise=0.3, seed=0):
    rng = np.random.default_rng(seed)
    length = int(seconds * RATE)
    refs = (0.1 * rng.standard_normal((n, channels, length))).astype(np.float32)
    ests = (refs + noise * 0.1 * rng.standard_normal(refs.shape)).astype(np.float32)
    return ests, refs


def museval_sdr(ests, refs):
    """museval.evaluate on our [n, C, S] layout; returns the 4 metric matrices [n, frames]."""
    return museval.evaluate(np.moveaxis(refs, 1, 2), np.moveaxis(ests, 1, 2), win=RATE, hop=RATE)


def assert_same_frames(ours, theirs, atol=1e-6):
    assert ours.shape == theirs.shape
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs))
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(theirs))
    finite = np.isfinite(theirs)
    assert finite.any()
    np.testing.assert_allclose(ours[finite], theirs[finite], rtol=0, atol=atol)


# --- SDR against museval -------------------------------------------------------------------
def test_framewise_sdr_equals_museval_with_silent_frames_and_mismatched_length():
    ests, refs = make_sources(channels=2, seconds=5.6)  # 5 full frames + a partial tail museval drops
    refs[1, :, 2 * RATE:3 * RATE + 17] = 0           # a silent reference frame (and a bit more)
    ests[0, :, 4 * RATE:4 * RATE + RATE] = 0         # a silent estimate frame
    ests[1, :, 100:200] *= -1                        # estimate differs: not a trivial check
    ests = ests[..., : refs.shape[-1] - int(1.3 * RATE)]   # too short: museval zero-pads
    sdr = museval_sdr(ests, refs)[0]
    ours = metrics.framewise_sdr(ests, refs, RATE, RATE)
    assert_same_frames(ours, sdr)
    # museval's NaN rule: a frame silent in one source is NaN for every source
    assert np.isnan(sdr[:, 2]).all() and np.isnan(sdr[:, 4]).all()
    # the zero padding of the short estimate makes frame 4 silent for the estimate as well
    assert np.isfinite(sdr[:, [0, 1, 3]]).all()


def test_framewise_sdr_equals_museval_for_longer_estimate_and_mono():
    ests, refs = make_sources(seconds=3.2, noise=1.5, seed=3)
    longer = np.concatenate([ests, ests[..., :999]], axis=-1)  # too long: museval crops
    assert_same_frames(metrics.framewise_sdr(longer, refs, RATE, RATE), museval_sdr(longer, refs)[0])


def test_track_shorter_than_window_is_one_frame_like_museval():
    ests, refs = make_sources(seconds=0.7, seed=4)
    sdr = museval_sdr(ests, refs)[0]
    assert sdr.shape == (2, 1)
    assert_same_frames(metrics.framewise_sdr(ests, refs, RATE, RATE), sdr)
    np.testing.assert_allclose(metrics.fast_sdr(ests[0], refs[0]), sdr[0, 0], atol=1e-6)


def test_perfect_estimate_is_infinite_sdr_like_museval_and_stored_as_nan():
    _, refs = make_sources(seconds=2.5, seed=5)
    sdr, isr, sir, sar = museval_sdr(refs.copy(), refs)
    assert np.isposinf(sdr).all()
    assert (isr > 200).all() and (sar > 200).all()
    assert np.isposinf(metrics.framewise_sdr(refs, refs, RATE, RATE)).all()
    assert np.isposinf(metrics.fast_sdr(refs[0], refs[0]))
    # museval stores inf as NaN, so the SiSEC median skips perfect frames
    assert np.isnan(metrics.track_median(sdr)).all()


def test_wholly_silent_stem_museval_refuses_and_we_give_nan():
    ests, refs = make_sources(seconds=2.2, seed=6)
    silent_ref = refs.copy()
    silent_ref[1] = 0
    with pytest.raises(ValueError, match="reference sources should be non-silent"):
        museval_sdr(ests, silent_ref)
    assert np.isnan(metrics.framewise_sdr(ests, silent_ref, RATE, RATE)).all()
    assert np.isnan(metrics.fast_sdr(ests[1], silent_ref[1]))
    assert np.isnan(metrics.si_sdr(ests[1], silent_ref[1]))
    silent_est = ests.copy()
    silent_est[0] = 0
    with pytest.raises(ValueError, match="estimated sources should be non-silent"):
        museval_sdr(silent_est, refs)
    assert np.isnan(metrics.si_sdr(silent_est[0], refs[0]))


def test_anti_phase_stereo_counts_as_silent_as_in_museval():
    # museval's silence test sums the channels first: L = -R is "silent" there, so it is here
    ests, refs = make_sources(channels=2, seconds=2.0, seed=7)
    refs[0, 1, :RATE] = -refs[0, 0, :RATE]
    sdr = museval_sdr(ests, refs)[0]
    assert np.isnan(sdr[:, 0]).all() and np.isfinite(sdr[:, 1]).all()
    assert_same_frames(metrics.framewise_sdr(ests, refs, RATE, RATE), sdr)


def test_track_median_equals_museval_evalstore_aggregation():
    ests, refs = make_sources(seconds=6.5, seed=8)
    refs[0, :, :RATE] = 0               # one NaN frame
    sdr, isr, sir, sar = museval_sdr(ests, refs)
    sdr[1, 3] = np.inf                  # a perfect frame: stored as NaN by museval
    store = museval.TrackStore(track_name="t", win=1, hop=1)
    for i, name in enumerate(["a", "b"]):
        store.add_target(name, {"SDR": sdr[i].tolist(), "SIR": sir[i].tolist(),
                                "ISR": isr[i].tolist(), "SAR": sar[i].tolist()})
    evals = museval.EvalStore()
    evals.add_track(store)
    theirs = evals.agg_frames_scores()
    ours = metrics.track_median(sdr)
    for i, name in enumerate(["a", "b"]):
        assert ours[i] == theirs[("t", name, "SDR")]  # exactly: same quantisation, same median
        assert ours[i] == sisec_median(sdr[i])          # and the SiSEC rule written out independently
    assert np.isnan(metrics.track_median(np.full((1, 3), np.nan))).all()  # every frame NaN -> NaN


def sisec_median(frames) -> float:
    """The SiSEC per-track rule by hand: each frame rounded half-even to 1e-5, inf dropped like NaN,
    median of what is left (NaN when nothing is)."""
    from decimal import Decimal

    kept = [float(Decimal(v).quantize(Decimal(".00001"))) for v in frames if np.isfinite(v)]
    return float(np.median(kept)) if kept else float("nan")


# --- aggregation of a tier's tracks (tiersep.evaluate.scoring, museval's EvalStore) --------------
def scored_tracks(seconds=(4.0, 3.0)):
    """Two real museval-scored tracks (2 mono sources); the first has its first reference second
    silent in source 0, so museval marks that frame NaN for every source."""
    from tiersep.evaluate.scoring import TrackTask, score_track

    results, whole_track = [], {}
    for seed, length in enumerate(seconds):
        ests, refs = make_sources(seconds=length, seed=20 + seed)
        if seed == 0:
            refs[0, :, :RATE] = 0
        mixture = refs.sum(axis=0)
        results.append(score_track(TrackTask(f"t{seed}", ests, refs, mixture, ["a", "b"], RATE)))
        whole_track[f"t{seed}"] = {s: {"si_sdr": metrics.si_sdr(ests[i], refs[i]),
                                       "si_sdr_mixture": metrics.si_sdr(mixture, refs[i])}
                                   for i, s in enumerate(["a", "b"])}
    return results, whole_track


def test_aggregate_scores_counts_valid_frames_and_takes_the_sisec_medians():
    from tiersep.evaluate.scoring import aggregate_scores

    results, whole_track = scored_tracks()
    scores = aggregate_scores(results, whole_track, ["a", "b"])
    first, second = scores["per_track"]["t0"], scores["per_track"]["t1"]
    assert [first[s]["frames"] for s in "ab"] == [4, 4] and [second[s]["frames"] for s in "ab"] == [3, 3]
    assert [first[s]["valid_frames"] for s in "ab"] == [3, 3]   # the silent second is dropped for both
    assert [second[s]["valid_frames"] for s in "ab"] == [3, 3]
    for name, result in zip(("t0", "t1"), results):
        frames = json_frames(result["museval_json"])
        for i, stem in enumerate("ab"):
            entry = scores["per_track"][name][stem]
            assert entry["sdr"] == sisec_median(frames[stem]["SDR"])
            assert entry["sar"] == sisec_median(frames[stem]["SAR"])
            assert entry["sdr_mixture"] == sisec_median(result["sdr_mixture_frames"][i])
            assert entry["si_sdr"] == whole_track[name][stem]["si_sdr"]   # whole-track value, not rounded
    for stem in "ab":  # per stem: median over the tracks (of two values: their mean)
        for key in ("sdr", "si_sdr", "sdr_mixture"):
            expected = np.median([scores["per_track"][t][stem][key] for t in ("t0", "t1")])
            assert scores["per_stem"][stem][key] == pytest.approx(expected, abs=1e-12)
        assert scores["per_stem"][stem]["sdr_improvement"] == pytest.approx(
            scores["per_stem"][stem]["sdr"] - scores["per_stem"][stem]["sdr_mixture"])
    assert scores["overall"]["sdr"] == pytest.approx(np.mean([scores["per_stem"][s]["sdr"] for s in "ab"]))


def json_frames(museval_json: str) -> dict:
    """{target: {metric: [frame values]}} from museval's TrackStore JSON (NaN where stored NaN)."""
    import simplejson

    data = simplejson.loads(museval_json, allow_nan=True)
    return {t["name"]: {m: [float(f["metrics"][m]) for f in t["frames"]] for m in ("SDR", "SIR", "ISR", "SAR")}
            for t in data["targets"]}


def test_aggregate_scores_skips_a_track_museval_refused():
    from tiersep.evaluate.scoring import TrackTask, aggregate_scores, score_track

    results, whole_track = scored_tracks()
    ests, refs = make_sources(seconds=2.0, seed=30)
    refs[1] = 0                                     # a wholly silent stem: museval refuses the track
    refused = score_track(TrackTask("t2", ests, refs, refs.sum(axis=0), ["a", "b"], RATE))
    assert refused["museval_json"] is None and "museval refused" in refused["error"]
    whole_track["t2"] = {s: {"si_sdr": metrics.si_sdr(ests[i], refs[i]), "si_sdr_mixture": float("nan")}
                         for i, s in enumerate("ab")}
    scores = aggregate_scores(results + [refused], whole_track, ["a", "b"])
    entry = scores["per_track"]["t2"]["a"]
    assert entry["frames"] == 2 and entry["valid_frames"] == 0 and np.isnan(entry["sdr"])
    assert np.isfinite(entry["si_sdr"])             # SI-SDR is per stem: stem a is still scored
    both = aggregate_scores(results, {k: v for k, v in whole_track.items() if k != "t2"}, ["a", "b"])
    assert scores["per_stem"]["a"]["sdr"] == both["per_stem"]["a"]["sdr"]  # the median skipped t2


# --- SI-SDR against torchmetrics -----------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_si_sdr_equals_torchmetrics_zero_mean_on_mono(seed):
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal((1, 5000)) + 0.3           # a DC offset that zero_mean removes
    est = 0.7 * ref + 0.4 * rng.standard_normal((1, 5000)) - 0.2
    theirs = tm_si_sdr(torch.from_numpy(est[0]), torch.from_numpy(ref[0]), zero_mean=True).item()
    assert metrics.si_sdr(est, ref) == pytest.approx(theirs, abs=1e-9)
    # and it differs from torchmetrics' default (zero_mean=False) on offset signals
    default = tm_si_sdr(torch.from_numpy(est[0]), torch.from_numpy(ref[0])).item()
    assert abs(metrics.si_sdr(est, ref) - default) > 1e-3


def test_stereo_si_sdr_is_both_channels_as_one_signal_with_per_channel_mean_removed():
    rng = np.random.default_rng(9)
    ref = rng.standard_normal((2, 4000)) + np.array([[0.5], [-0.3]])
    noise = np.array([[0.1], [1.0]]) * rng.standard_normal((2, 4000))  # channels of unequal quality
    est = ref * 1.3 + noise + np.array([[0.1], [0.9]])
    joined = lambda x: torch.from_numpy((x - x.mean(axis=-1, keepdims=True)).reshape(-1))  # noqa: E731
    theirs = tm_si_sdr(joined(est), joined(ref), zero_mean=False).item()
    ours = metrics.si_sdr(est, ref)
    assert ours == pytest.approx(theirs, abs=1e-9)
    # one signal, not the mean of per-channel SI-SDRs
    per_channel = np.mean([metrics.si_sdr(est[c:c + 1], ref[c:c + 1]) for c in range(2)])
    assert abs(ours - per_channel) > 1e-3
    # invariant to a global gain and to per-channel offsets, not to a per-channel gain
    assert metrics.si_sdr(3 * est + np.array([[2.0], [-1.0]]), ref) == pytest.approx(ours, abs=1e-9)
    assert abs(metrics.si_sdr(est * np.array([[1.0], [2.0]]), ref) - ours) > 1e-3


def test_si_sdr_length_mismatch_pads_or_crops_like_museval():
    rng = np.random.default_rng(10)
    ref = rng.standard_normal((2, 3000))
    est = ref + 0.3 * rng.standard_normal((2, 3000))
    assert metrics.si_sdr(est[:, :2500], ref) == pytest.approx(
        metrics.si_sdr(np.pad(est[:, :2500], ((0, 0), (0, 500))), ref), abs=1e-12)
    assert metrics.si_sdr(np.concatenate([est, est[:, :10]], 1), ref) == pytest.approx(
        metrics.si_sdr(est, ref), abs=1e-12)


# --- torch variants ------------------------------------------------------------------------
def test_torch_variants_match_numpy_batched():
    # si_sdr/fast_sdr wrap the torch functions (checked against torchmetrics and museval above);
    # here: a batch gives each item's own value, NaN stays per item.
    ests, refs = make_sources(n=3, channels=2, seconds=0.5, seed=11)
    batch_est = torch.from_numpy(np.stack([ests, ests * 0.5]))   # [2, 3, C, S]
    batch_ref = torch.from_numpy(np.stack([refs, refs]))
    batch_ref[1, 2] = 0                                          # a silent reference -> NaN
    si, sdr = metrics.si_sdr_torch(batch_est, batch_ref), metrics.sdr_torch(batch_est, batch_ref)
    assert si.shape == sdr.shape == (2, 3)
    for b in range(2):
        for j in range(3):
            e, r = batch_est[b, j].numpy(), batch_ref[b, j].numpy()
            np.testing.assert_allclose(si[b, j].item(), metrics.si_sdr(e, r), atol=1e-9, equal_nan=True)
            np.testing.assert_allclose(sdr[b, j].item(), metrics.fast_sdr(e, r), atol=1e-9, equal_nan=True)
    assert torch.isnan(si[1, 2]) and torch.isnan(sdr[1, 2])
    assert torch.isposinf(metrics.sdr_torch(batch_ref[0], batch_ref[0])).all()
    # the whole-signal SDR of a segment one frame long is museval's SDR of that frame
    mono_ests, mono_refs = ests[:2, :1], refs[:2, :1]
    sdr_museval = museval_sdr(mono_ests, mono_refs)[0][:, 0]
    np.testing.assert_allclose(metrics.sdr_torch(torch.from_numpy(mono_ests), torch.from_numpy(mono_refs)).numpy(),
                               sdr_museval, atol=1e-6)
