"""``nonstop timeline``: a job's event log (``<job_dir>/events.jsonl``) as a model, a text summary
and a picture.

* :mod:`.model`: the value types (rank intervals, failures, recoveries with their stages,
  generations, nodes, tier marks, migrations, resizes, waits) and :class:`Timeline`;
* :mod:`.loading`: the log read and checked (:func:`load_events`), its typed events turned into a
  :class:`Timeline` (:func:`build_timeline`), with :mod:`.ranks` (who played each rank when),
  :mod:`.swaps` (migrations and grows: one builder for boundary swaps) and :mod:`.shrinks` (waits
  for a spare, shrinks);
* :mod:`.text`: :func:`timeline_text`, the summary for a terminal;
* :mod:`.render`: :func:`render_timeline`, one painter per row or layer on the :mod:`.style`
  canvas (PNG, SVG or PDF by the file's extension);
* :mod:`.trace`: :func:`timeline_trace` / :func:`write_trace`, the same as Chrome-trace /
  Perfetto JSON, and :func:`check_trace`, the format's rules; :mod:`.output` picks picture or
  trace for ``nonstop timeline --format``.
"""

from __future__ import annotations

from nonstop.timeline.loading import EVENTS_FILE, build_timeline, load_events, load_timeline
from nonstop.timeline.model import (
    STAGE_ORDER,
    CatchupMark,
    ElasticResize,
    ElasticWait,
    FailureMark,
    Generation,
    Mark,
    MigrationSpan,
    NodeSpan,
    OtherEvent,
    RankInterval,
    Recovery,
    StageSpan,
    Timeline,
)
from nonstop.timeline.render import FORMATS, render_timeline
from nonstop.timeline.text import timeline_text
from nonstop.timeline.trace import check_trace, timeline_trace, write_trace

__all__ = [
    "EVENTS_FILE",
    "FORMATS",
    "STAGE_ORDER",
    "CatchupMark",
    "ElasticResize",
    "ElasticWait",
    "FailureMark",
    "Generation",
    "Mark",
    "MigrationSpan",
    "NodeSpan",
    "OtherEvent",
    "RankInterval",
    "Recovery",
    "StageSpan",
    "Timeline",
    "build_timeline",
    "check_trace",
    "load_events",
    "load_timeline",
    "render_timeline",
    "timeline_text",
    "timeline_trace",
    "write_trace",
]
