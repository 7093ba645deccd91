"""Listen: per tier, the excerpt evaluate encoded (tiersep.evaluate.listen) as audio players, the
mixture first, then each stem's estimate beside its reference. index.html embeds the files as
data: URIs (its Content-Security-Policy allows media from data: only); report.md cannot play
audio, so it lists the excerpts and where their files are."""
from __future__ import annotations

from dataclasses import dataclass, field

from tiersep.report.collect import Tier
from tiersep.report.sections.table import Column, Table, make_table
from tiersep.report.units import format_bytes


@dataclass
class StemPlayers:
    stem: str
    estimate: str | None    # data: URI
    reference: str | None


@dataclass
class ListenTier:
    name: str
    status: str
    caption: str
    mixture: str | None     # data: URI
    stems: list[StemPlayers]
    bytes: int


@dataclass
class ListenSection:
    tiers: list[ListenTier]
    summary: Table                              # what report.md shows instead of the players
    notes: list[str] = field(default_factory=list)


def _span(record: dict) -> str:
    """'12.5 s to 22.5 s of the track (10.0 s)'."""
    start, seconds = record["start"], record["seconds"]
    return f"{start:.1f} s to {start + seconds:.1f} s of the track ({seconds:.1f} s)"


def _caption(tier: Tier) -> str:
    record = tier.listen.record
    return (f"{record['track']}: {_span(record)}; Opus {record['kbps']} kbit/s, "
            f"{format_bytes(record['bytes'])} in all")


def _players(tier: Tier) -> ListenTier:
    listen = tier.listen
    uris = {(clip.role, clip.stem): listen.data_uri(clip) for clip in listen.clips}
    stems = list(dict.fromkeys(clip.stem for clip in listen.clips if clip.stem is not None))
    return ListenTier(tier.name, tier.status, _caption(tier), uris.get(("mixture", None)),
                      [StemPlayers(s, uris.get(("estimate", s)), uris.get(("reference", s))) for s in stems],
                      listen.record["bytes"])


def _no_excerpt(tier: Tier) -> str:
    if tier.listen_error is not None:
        return f"{tier.name}: its excerpt could not be read (see Failures and refusals)."
    return (f"{tier.name}: no excerpt (evaluated with evaluate.listen_seconds: 0, or before evaluate "
            "wrote excerpts).")


def listen_section(tiers: list[Tier]) -> ListenSection:
    heard = [t for t in tiers if t.listen is not None]
    columns = [Column("", "Track", lambda t: t.listen.record["track"], numeric=False),
               Column("", "Excerpt", lambda t: _span(t.listen.record), numeric=False),
               Column("", "Files", lambda t: f"{t.listen.folder} ({format_bytes(t.listen.record['bytes'])})",
                      numeric=False)]
    summary = make_table("listen-summary", "Tier", columns, heard, key=lambda t: t.name,
                         status=lambda t: t.status, empty="No tier has an excerpt yet.", split_markdown=False)
    notes = [_no_excerpt(t) for t in tiers if t.listen is None and (t.scores is not None or t.listen_error)]
    return ListenSection([_players(t) for t in heard], summary, notes)
