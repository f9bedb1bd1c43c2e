"""Exact lane placement for small instances (OR-Tools CP-SAT): how far is the heuristic from optimal?

The model takes the same task DAG the list scheduler places (``graph.build_step(cfg)``, without
activation offload tasks) and asks for the shortest step under the lane rules:

* one fixed-size interval per task; integer durations are the task's µs scaled by
  ``scale`` (default 100: 10 ns resolution) and rounded *up*;
* NoOverlap per (stage, lane) resource (a lane runs one task at a time);
* ``end(dep) <= start(task)`` for every dependency; ``graph.start_deps`` are start-to-start
  (``start(trigger) <= start(task)``);
* in ``backbone`` mode (the default), the pipeline schedule's slot gate on the compute lane (see
  [Note: backbone-constrained mode]);
* minimise the makespan, bounded above by the heuristic's makespan (its lane orders re-timed with
  the rounded durations, which is a feasible solution given to CP-SAT as a hint).

[Note: backbone-constrained mode]
The issue asks for the exact *lane placement of a plan*: the optimum given the chosen pipeline
schedule. ``mode="backbone"`` constrains the compute lane the way the heuristic's slot gate does
(``listsched.list_schedule``): per rank, the *main* compute tasks (compute lane, not WGrad, not
optim; slot from ``planner.slot_index`` of the backbone and the graph's ``unit`` map, exactly as
``listsched.prepare`` assigns it) are grouped by slot G_0, G_1, ... (slots with main tasks, in
order); a task of G_p may start only once every task of G_0..G_{p-1-lookahead} has started. It is
written as the linear constraints ``start(t) >= start(u)`` for t in G_p and u in
G_{p-1-lookahead-j}, j = 0..lookahead: by induction on p they imply the gate on every earlier group.
WGrad, optimizer and non-compute tasks (EP all-to-alls, P2P, collectives) are free, so the
model still chooses when each dW fills the compute lane and how transfers interleave.
``lookahead`` is the one the plan used (``schedule.lookahead``; 0 for serial or memory-lean plans).
Any schedule the heuristic produces on that backbone satisfies the gate, so its makespan is an
upper bound (hinted); plans on another backbone generally violate it and are not used as hints.

[Note: WGrad deadline]
The heuristic also bounds dW deferral (``schedule.wgrad_lag``, a memory policy: a deferred dW keeps
its activations and output gradient alive): a WGrad of slot s has priority key s + wgrad_lag, so
once ready it is never bypassed by a main task of a later slot; with wgrad_lag >= lookahead it is
ready by then (its dX, of slot s, has run). ``solve_exact(wgrad_lag=k)`` adds that as
``start(dW of slot s) <= start(t)`` for main tasks t of slots > s + k: the optimum given the
backbone *and* the deferral bound. The default (None) leaves WGrad free, as the acceptance
test does.

[Note: exact model scope]
``mode="free"`` drops the gate: the exact model may interleave forwards, dX and dW in any order the
DAG allows (e.g. run forwards ahead of the 1F1B order). That gap measures the heuristic *and its
backbone* against the best any lane placement of the DAG can do. In both modes *memory is not
modeled*: no device budget, no activation lifetimes, so the free optimum may hold every
micro-batch's activations at once (a GPipe-like order with every dW deferred). The free optimum is
a bound on what any schedule of this DAG can reach, not a memory-feasible plan; the backbone
optimum keeps the schedule's forward/backward order, which is what bounds memory in practice
(dW deferral is still unbounded). ``solve_free`` is the free mode with the device budget and the
storage of every activation set modeled ([Note: exact free-order model]; ``k3sched plan --exact
--exact-order free``).

[Note: rounding]
Let D be the real durations and D' = ceil(D * scale) / scale. Starts that are feasible under D'
stay feasible under D, so ``makespan_us`` (the found starts re-evaluated with the real durations)
is achievable. Conversely an optimal schedule under D becomes feasible under D' by shifting every
task by the sum of the rounding increments of the tasks started before it (the shift is monotone
in the start time, so start-to-start constraints such as the backbone gate stay satisfied), so
OPT(D) >= OPT(D') - sum(D' - D): ``bound_us`` is the CP-SAT bound minus that sum, a valid lower
bound on the real optimum. With n tasks the two differ by at most n / scale µs.

[Note: exact memory model]
With ``budget_bytes`` a reservoir constraint per stage adds each task's ``alloc.device`` at its
start and subtracts ``free.device`` (and a receive's ``release`` of its sender's buffer) at its
end; the level (on top of the stage's static bytes) stays within the budget. CP-SAT nets events
at one instant together, as the planner's timeline puts frees before allocations. Found starts
re-timed with the real (shorter) durations free memory no later, so ``makespan_us`` is a
schedule within the budget. Hints (e.g. a k3 plan under the same budget) are re-timed with the
rounded durations and used only if they stay within it.

Layout: ``common.py`` (the result, integer durations, re-timed hints, bounds), ``backbone.py``
(``solve_exact``, ``exact_report``, the backbone gate), ``free.py`` (``solve_free``,
``free_report``: [Note: exact free-order model], [Note: memory as a cumulative]). This package
re-exports their public names.
"""

from .backbone import backbone_groups, backbone_pairs, exact_report, gate_violations, plan_lookahead, solve_exact
from .common import MAX_TASKS, MODES, ExactResult, Hint
from .free import ACT_CHOICES, free_report, solve_free

__all__ = ["ACT_CHOICES", "MAX_TASKS", "MODES", "ExactResult", "Hint", "backbone_groups", "backbone_pairs",
           "exact_report", "free_report", "gate_violations", "plan_lookahead", "solve_exact", "solve_free"]
