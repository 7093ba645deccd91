"""Quality on the test set: SI-SDR and SDR per stem and their mean, the museval frames each score
rests on, and the evaluation protocols."""
from __future__ import annotations

from tiersep.report.collect import Tier
from tiersep.report.sections.table import Cell, Column, Table, make_table
from tiersep.report.sections.tiers import overall_db
from tiersep.report.units import MISSING, format_db, format_int

FEW_FRAMES = 0.5  # a track and stem with fewer valid museval frames than this share is flagged


def stems_of(tiers: list[Tier]) -> list[str]:
    for tier in tiers:
        if tier.scores:
            return list(tier.scores.get("sources") or tier.scores.get("per_stem") or [])
    return []


def _frames_text(frames: tuple[int, int] | None) -> Cell:
    if frames is None:
        return Cell(MISSING, css="na", title="scores.json without frame counts")
    valid, total = frames
    few = total and valid < FEW_FRAMES * total
    return Cell(f"{valid} / {total}", css="flag" if few else "",
                title="museval frames whose SDR is defined / all 1 s frames")


def quality_table(tiers: list[Tier]) -> Table:
    evaluated = [t for t in tiers if t.scores]
    stems = stems_of(evaluated)

    def stem_value(stem: str, key: str):
        return lambda t: format_db(((t.scores.get("per_stem") or {}).get(stem) or {}).get(key))

    columns = [Column("Test set", "Tracks", lambda t: format_int(t.scores.get("tracks"))),
               Column("Test set", "Valid frames", lambda t: _frames_text(t.frames))]
    for stem in stems:
        columns += [Column(stem, "SI-SDR", stem_value(stem, "si_sdr")),
                    Column(stem, "SDR", stem_value(stem, "sdr")),
                    Column(stem, "SI-SDR impr.", stem_value(stem, "si_sdr_improvement"))]
    columns += [Column("mean of stems", "SI-SDR", lambda t: overall_db(t, "si_sdr")),
                Column("mean of stems", "SDR", lambda t: overall_db(t, "sdr")),
                Column("mean of stems", "SI-SDR impr.", lambda t: overall_db(t, "si_sdr_improvement")),
                Column("mean of stems", "SDR impr.", lambda t: overall_db(t, "sdr_improvement")),
                Column("mean of stems", "SI-SDR of mixture", lambda t: overall_db(t, "si_sdr_mixture"))]
    return make_table("quality", "Tier", columns, evaluated, key=lambda t: t.name, status=lambda t: t.status,
                      empty="No tier has been evaluated yet.")


def few_frames(tier: Tier) -> list[tuple[str, str, int, int]]:
    """(track, stem, valid, total) where fewer than half the track's frames were valid."""
    out = []
    for track, stems in ((tier.scores or {}).get("per_track") or {}).items():
        for stem, entry in stems.items():
            if "frames" in entry and entry["frames"] and entry["valid_frames"] < FEW_FRAMES * entry["frames"]:
                out.append((track, stem, entry["valid_frames"], entry["frames"]))
    return out


def frames_table(tiers: list[Tier]) -> Table:
    """Per evaluated tier and test track: valid / total museval frames of each stem."""
    evaluated = [t for t in tiers if t.scores]
    stems = stems_of(evaluated)
    rows = [(tier, track, entries) for tier in evaluated
            for track, entries in (tier.scores.get("per_track") or {}).items()]

    def stem_cell(stem: str):
        def cell(row) -> Cell:
            entry = row[2].get(stem) or {}
            return _frames_text((entry["valid_frames"], entry["frames"]) if "frames" in entry else None)
        return cell

    columns = [Column("", "Track", lambda r: r[1], numeric=False)]
    columns += [Column("", stem, stem_cell(stem)) for stem in stems]
    table = make_table("frames", "Tier", columns, rows, key=lambda r: r[0].name, status=lambda r: r[0].status,
                       row_css=lambda r: "flagged" if any(
                           few[0] == r[1] for few in few_frames(r[0])) else "",
                       empty="No tier has been evaluated yet.", split_markdown=False)
    flagged = [f"{tier.name}: {track} ({stem} {valid}/{total})" for tier in evaluated
               for track, stem, valid, total in few_frames(tier)]
    table.notes.append(
        "museval scores 1 s frames and leaves out every frame in which a reference stem (or an estimate) "
        "is silent; a track's SDR is the median over the frames left. Fewer than half valid: "
        + ("; ".join(flagged) + " (⚑): their medians rest on few frames." if flagged else "no track."))
    return table


def protocols(tiers: list[Tier]) -> list[str]:
    """The distinct evaluation protocols (scores.json 'protocol') of the evaluated tiers."""
    return list(dict.fromkeys(str(t.scores["protocol"]) for t in tiers if t.scores and t.scores.get("protocol")))
