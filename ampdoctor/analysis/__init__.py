"""From records to a Report, one file per job:

    ranking.py     run the rules, rank the findings (root cause first), build the Report
    panels.py      the data panels the reporters draw
    merging.py     a run directory: its ranks read, FSDP2 shards combined, the ranks' reports merged
    replaychoice.py which capture a report replays
    replayfold.py  an in-process replay folded into a report
"""
from __future__ import annotations

from .merging import diagnose_run_dir
from .ranking import build_report, rank
from .replayfold import merge_capture_replay, merge_replay

__all__ = ["build_report", "diagnose_run_dir", "merge_capture_replay", "merge_replay", "rank"]
