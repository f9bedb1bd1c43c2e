"""Trace reading and plan-conformance validation (docs/design.md, section 6; docs/formats.md).

Layers (Holistic-Trace-Analysis style): readers turn one file into one ``EventTable``
(``traces.events``, see [Note: event table]); ``traces.validate`` joins the table to a plan by
task id and returns a ``Report``; ``traces.cli`` is the command line; ``traces.synth`` builds
ideal traces of a plan (tests, seeded faults); ``traces.nsys.record`` runs a command under
Nsight Systems and exports SQLite.

Imports only ``k3sched.tasks``, numpy and the standard library.
"""

from traces.chrome import read_kineto, read_runtime_trace, read_trace, read_traces
from traces.events import KINDS, EventTable, TraceError
from traces.nsys import read_nsys_sqlite, record

__all__ = ["EventTable", "KINDS", "TraceError", "read_trace", "read_traces", "read_nsys_sqlite",
           "read_kineto", "read_runtime_trace", "record"]
