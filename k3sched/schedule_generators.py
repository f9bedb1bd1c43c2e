"""The pipeline schedule generators (one function per name in ``schedules.GENERATORS``), each
returning a compact per-rank order on the data model of :mod:`k3sched.schedule_ir`
([Note: schedule data model]); ``schedules.generate`` picks one by name and checks its result.

[Note: dualpipe mapping]
DualPipe (bidirectional) holds two copies of the model's ``pp`` stages, placed so that rank r
holds model stage r of the "down" copy and model stage pp-1-r of the "up" copy. We express the
copies as ``2*pp`` virtual stages with the V placement: vstage v < pp is the down copy of model
stage v (on rank v), vstage pp + k the up copy of model stage k (on rank pp-1-k), so rank r
holds vstages r and 2*pp-1-r like DualPipeV. Micro-batches ``0 .. M/2-1`` go down (vstages
``0..pp-1``) and ``M/2 .. M-1`` go up (vstages ``pp..2pp-1``): each micro-batch visits only the
``pp`` vstages of its route (``Schedule.route(mb)``). Parameters (and their gradients) are 2x;
torch's loader cannot load it (it expects every stage to see every micro-batch). Chimera
(``chimera``) uses the same mapping with its own order and full backwards.

[Note: controllable-memory V schedules]
V-Half and V-Min (Qi et al., NeurIPS 2024) repeat one *building block* per micro-batch on the V
placement: rank r runs F of chunk 0, F of chunk 1, I of chunk 1, I of chunk 0 at fixed offsets
(``_v_block_offsets``), the block repeating every 6 units of F = I = W. The block's *lifespan*
(F of chunk 0 to the W after I of chunk 0, about 4p units for V-Min and 6p for V-Half, against
12p for ZB-V / 1F1B) divided by the 6-unit interval is how many blocks overlap, hence the peak:
(p+4)//3 micro-batches of a rank's activations for V-Min, (p+2)//2 for V-Half, against 1F1B's p.

[Note: pipedream-2bw]
PipeDream-2BW (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021)
trains without a pipeline flush: the forwards and backwards of step t+1 fill step t's drain, and
weights are double-buffered. Its plan spans two consecutive training steps t and t+1 (t even: the
k-th run of the plan covers steps 2k and 2k+1), so the steady state is visible in one plan. Runs
of the plan follow one another, and the pipeline drains at the end of each: one fill and one drain
per two steps, where 1F1B pays one per step.

* micro-batches ``0 .. M-1`` are step t's, ``M .. 2M-1`` step t+1's (M = ``parallel.microbatches``);
  the backbone is 1F1B over the 2M micro-batches with no flush between them (:func:`gen_pipedream_2bw`);
* the optimizer task of step t on stage s is ``s{s}/step/optim.run``, that of step t+1
  ``s{s}/step1/optim.run`` ([Note: task id grammar] in k3sched/tasks.py). Each depends on its own
  step's backward work (and gradient reduction, whose ids name the step's last micro-batch) on the
  stage only, and every task of step t+1 on the stage that adds to a parameter gradient (the dW
  tasks and router.bwd) waits for step t's optimizer, so one gradient buffer serves both steps.

Weight versions. W_0 are the initial weights and W_{-1} := W_0. Every micro-batch of step t, at
every stage, runs its forward *and* its backward on W_{t-1} (weight stashing: the version it
started with), so step t's gradient is g_t = grad L_t(W_{t-1}). Step t's optimizer applies it to
the newest version with a one-step delay: W_{t+1} = AdamW(W_t, g_t), i.e. W(t+1) = W(t) - lr *
grad f(W(t-1)) of the paper, with AdamW's moments updated in step order. A stage therefore holds
two versions: while step t runs on W_{t-1}, W_t (made by step t-1's optimizer) is what step t+1
runs on; step t's optimizer writes W_{t+1} over W_{t-1}'s buffer once step t's last backward on
the stage is done. Step t+1 never needs W_{t+1}, so no task of step t+1 waits for step t's
optimizer except the weight-gradient accumulation above. Steps 0 and 1 both run on W_0.

This changes the training semantics (stale weights, one step late), as the paper says; it is not
the synchronous reference's training: ``runtime.reference.reference_run(..., delayed=True)`` is
its reference. The planner counts the second version's weight bytes in the stage's static memory
(:meth:`k3sched.cost.CostModel.weight_bytes`; also in the memory bound). The paper needs
m >= p micro-batches per step for two versions to suffice in an endless pipeline; the config rule
asks for it.
"""

from __future__ import annotations

from collections import defaultdict

from .schedule_ir import Action, Pair, Placement, Schedule, Slot, deps_of


class _Rank:
    """Builds one rank's order with per-(vstage, op) micro-batch counters."""

    def __init__(self, limit: int) -> None:
        self.slots: list[Slot] = []
        self.next: dict[tuple[int, str], int] = defaultdict(int)
        self.wq: list[Action] = []  # pending weight backwards, oldest first
        self.limit = limit

    def take(self, v: int, op: str) -> Action:
        key = (v, "I" if op == "B" else op)
        a = Action(v, op, self.next[key])
        self.next[key] += 1
        if op == "I":
            self.wq.append(Action(v, "W", a.mb))
        return a

    def do(self, v: int, op: str) -> None:
        self.slots.append(self.take(v, op))

    def w(self) -> None:
        if self.wq:
            self.slots.append(self.wq.pop(0))

    def pair(self, fv: int, bv: int, bop: str = "B") -> None:
        self.slots.append(Pair(self.take(fv, "F"), self.take(bv, bop)))

    def trimmed(self) -> list[Slot]:
        """Drop actions of micro-batches >= limit (generators may over-generate then trim)."""
        out: list[Slot] = []
        for s in self.slots:
            if isinstance(s, Pair):
                keep = [a for a in s.parts if a.mb < self.limit]
                if len(keep) == 2:
                    out.append(s)
                elif keep:
                    out.append(keep[0])
            elif s is not None and s.mb < self.limit:
                out.append(s)
        return out


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def gen_gpipe(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    require(vpp == 1, f"gpipe places one stage per rank; needs vpp 1, got {vpp}")
    ranks = {r: [Action(r, "F", m) for m in range(M)] + [Action(r, "B", m) for m in range(M)] for r in range(pp)}
    return Schedule("gpipe", pp, 1, M, Placement("loop", pp, 1), ranks)


def gen_1f1b(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    require(vpp == 1, f"1f1b places one stage per rank; needs vpp 1, got {vpp}")
    ranks = {}
    for r in range(pp):
        k, warm = _Rank(M), min(pp - 1 - r, M)
        for _ in range(warm):
            k.do(r, "F")
        for _ in range(M - warm):
            k.do(r, "F")
            k.do(r, "B")
        for _ in range(warm):
            k.do(r, "B")
        ranks[r] = k.slots
    return Schedule("1f1b", pp, 1, M, Placement("loop", pp, 1), ranks)


def gen_interleaved(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    """Megatron's interleaved 1F1B: micro-batches in groups of pp, chunk by chunk; warm-up of
    (pp-1-r)*2 + (vpp-1)*pp chunk-forwards, plus ``extra`` (Kimi K2's extra warm-up)."""
    require(vpp >= 2, f"interleaved-1f1b needs vpp >= 2; got {vpp}")
    require(M % pp == 0, f"interleaved-1f1b needs microbatches a multiple of pp ({pp}); got {M}")
    place = Placement("loop", pp, vpp)
    total = M * vpp

    def fwd(k: int) -> tuple[int, int]:  # k-th forward on a rank -> (chunk, mb)
        group, within = divmod(k, pp * vpp)
        return (within // pp), group * pp + within % pp

    ranks = {}
    for r in range(pp):
        warm = min(total, (pp - 1 - r) * 2 + (vpp - 1) * pp + extra)
        order: list[Slot] = []
        for k in range(warm):
            c, m = fwd(k)
            order.append(Action(place.vstage(r, c), "F", m))
        for k in range(total - warm):
            c, m = fwd(warm + k)
            order.append(Action(place.vstage(r, c), "F", m))
            c, m = fwd(k)
            order.append(Action(place.vstage(r, vpp - 1 - c), "B", m))
        for k in range(total - warm, total):
            c, m = fwd(k)
            order.append(Action(place.vstage(r, vpp - 1 - c), "B", m))
        ranks[r] = order
    return Schedule("interleaved-1f1b", pp, vpp, M, place, ranks)


def gen_zb_h1(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    """ZB-H1: 1F1B's warm-up (pp-1-r forwards), then F I W with rank r keeping r W's pending,
    which fill its cool-down waits for I's from downstream; at most pp micro-batches in flight."""
    require(vpp == 1, f"zb-h1 places one stage per rank; needs vpp 1, got {vpp}")
    ranks = {}
    for r in range(pp):
        k, warm = _Rank(M), min(pp - 1 - r, M)
        delay = min(r, M - warm)
        for _ in range(warm):
            k.do(r, "F")
        for i in range(M - warm):
            k.do(r, "F")
            k.do(r, "I")
            if i >= delay:
                k.w()
        for _ in range(warm):
            k.do(r, "I")
            k.w()
        while k.wq:
            k.w()
        ranks[r] = k.slots
    return Schedule("zb-h1", pp, 1, M, Placement("loop", pp, 1), ranks)


def _greedy_zb(pp: int, M: int, limit: list[int]) -> dict[int, list[Slot]]:
    """List-schedule F, I, W on pp ranks (vpp 1) with unit nominal durations: each free rank
    runs, in priority order, a ready I (critical path), a ready F while fewer than ``limit[r]``
    micro-batches hold activations (F .. W), else its oldest pending W; else it idles. The order
    is derived once with F = I = W = 1; simulate_uniform then times it under any costs."""
    done_at: dict[Action, int] = {}
    nf = [0] * pp
    ni = [0] * pp
    wq: list[list[int]] = [[] for _ in range(pp)]
    held = [0] * pp
    ranks: dict[int, list[Slot]] = {r: [] for r in range(pp)}
    t = 0
    remaining = 3 * M * pp
    while remaining:
        for r in range(pp):
            pick: Action | None = None
            if ni[r] < nf[r]:
                a = Action(r, "I", ni[r])
                need = Action(r + 1, "I", ni[r]) if r + 1 < pp else Action(r, "F", ni[r])
                if done_at.get(need, t + 1) <= t:
                    pick = a
            if pick is None and nf[r] < M and held[r] < limit[r]:
                if r == 0 or done_at.get(Action(r - 1, "F", nf[r]), t + 1) <= t:
                    pick = Action(r, "F", nf[r])
            if pick is None and wq[r]:
                pick = Action(r, "W", wq[r][0])
            if pick is None:
                continue
            if pick.op == "F":
                nf[r] += 1
                held[r] += 1
            elif pick.op == "I":
                ni[r] += 1
                wq[r].append(pick.mb)
            else:
                wq[r].pop(0)
                held[r] -= 1
            done_at[pick] = t + 1
            ranks[r].append(pick)
            remaining -= 1
        t += 1
    return ranks


def gen_zb_h2(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    """ZB-H2: up to 2*pp-1 micro-batches in flight on every rank (about 2x 1F1B's pp): the
    extra warm-up forwards fill the wait for the first I, pending W's fill the cool-down."""
    require(vpp == 1, f"zb-h2 places one stage per rank; needs vpp 1, got {vpp}")
    ranks = _greedy_zb(pp, M, [2 * pp - 1] * pp)
    return Schedule("zb-h2", pp, 1, M, Placement("loop", pp, 1), ranks)


def gen_zb_v(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    """ZB-V (Qi et al., 2024, handcrafted V schedule): V placement, two chunks per rank.

    Rank r: 2(pp-r)-1 chunk-0 forwards; r x (F1, F0); (pp-r) x (F1, I1, W1); steady
    (F0, I0, W0, F1, I1, W1) while forwards remain; cool-down r x (I0, I1) and (pp-r) x (I0, W0);
    then the pending W's. Generated for max(M, 2pp-1) micro-batches, the extra ones dropped.
    """
    require(vpp == 2, f"zb-v places two chunks per rank (V shape); needs vpp 2, got {vpp}")
    place = Placement("v", pp, 2)
    n = max(M, 2 * pp - 1)
    ranks = {}
    for r in range(pp):
        s0, s1 = place.stages_of(r)
        k = _Rank(M)
        cnt = {("F", 0): 0, ("F", 1): 0}

        def f(c: int) -> None:
            k.do((s0, s1)[c], "F")
            cnt[("F", c)] += 1

        def iw(c: int) -> None:
            v = (s0, s1)[c]
            a = k.take(v, "I")
            k.wq.remove(Action(v, "W", a.mb))
            k.slots += [a, Action(v, "W", a.mb)]

        for _ in range(2 * (pp - r) - 1):
            f(0)
        for _ in range(r):
            f(1)
            f(0)
        for _ in range(pp - r):
            f(1)
            iw(1)
        while cnt[("F", 1)] < cnt[("F", 0)] or cnt[("F", 0)] < n:
            if cnt[("F", 0)] < n:
                f(0)
            iw(0)
            f(1)
            iw(1)
        for _ in range(r):
            k.do(s0, "I")
            k.do(s1, "I")
        for _ in range(pp - r):
            k.do(s0, "I")
            k.slots.append(k.wq.pop(k.wq.index(min((w for w in k.wq if w.vstage == s0), key=lambda w: w.mb))))
        for v in (s1, s0):
            for w in sorted((w for w in k.wq if w.vstage == v), key=lambda w: w.mb):
                k.slots.append(w)
        k.wq.clear()
        ranks[r] = k.trimmed()
    return Schedule("zb-v", pp, 2, M, place, ranks)


def gen_dualpipev(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    """DeepSeek DualPipeV (the "cut-in-half" DualPipe): V placement, two chunks per rank.

    Rank r, chunk 0 = vstage r, chunk 1 = vstage 2pp-1-r, in eight phases:
    1. 2(pp-1-r) x F0;  2. (r+1) x (F0, F1);  3. (pp-1-r) x (I1, W, F1);
    4. (M-2pp+r+1) x (F0&B1, F1&B0) -- on the last rank the first F0&B1 runs unpaired;
    5. (pp-1-r) x (B1, F1&B0);  6. (r+1) x (B1, B0), split into I's from the middle on;
    7. (pp-1-r) x (W, B0 or I0);  8. (r+1) x W.  W's run oldest first ("W" = the weight queue).
    """
    require(vpp == 2, f"dualpipev places two chunks per rank (V shape); needs vpp 2, got {vpp}")
    require(M >= 2 * pp, f"dualpipev needs microbatches >= 2*pp = {2 * pp}; got {M}")
    place = Placement("v", pp, 2)
    ranks = {}
    for r in range(pp):
        s0, s1 = place.stages_of(r)
        k = _Rank(M)
        for _ in range(2 * (pp - 1 - r)):
            k.do(s0, "F")
        for _ in range(r + 1):
            k.do(s0, "F")
            k.do(s1, "F")
        for _ in range(pp - 1 - r):
            k.do(s1, "I")
            k.w()
            k.do(s1, "F")
        for i in range(M - 2 * pp + r + 1):
            if i == 0 and r == pp - 1:
                k.do(s0, "F")
                k.do(s1, "B")
            else:
                k.pair(s0, s1)
            k.pair(s1, s0)
        for _ in range(pp - 1 - r):
            k.do(s1, "B")
            k.pair(s1, s0)
        split = False
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            k.do(s1, "I" if split else "B")
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            k.do(s0, "I" if split else "B")
        for _ in range(pp - 1 - r):
            k.w()
            k.do(s0, "I" if split else "B")
        while k.wq:
            k.w()
        ranks[r] = k.slots
    return Schedule("dualpipev", pp, 2, M, place, ranks)


def gen_dualpipe(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    """DeepSeek DualPipe (bidirectional): pp ranks (even), M micro-batches, M/2 fed from each end
    (see [Note: dualpipe mapping]). Rank R with half-rank h = min(R, pp-1-R) runs DualPipeV's
    rank-h order for pp/2 ranks and M/2 micro-batches: DualPipeV's chunk 0 is R's stage in the
    direction where R comes early (down for R < pp/2, up otherwise) and chunk 1 its stage in the
    other direction. Each micro-batch then meets the same neighbours in the same order as in
    DualPipeV, so the bubble is DualPipe's (PP/2-1)(F&B+B-3W) with PP = pp."""
    require(vpp == 2, f"dualpipe holds two stages per rank (two copies); needs vpp 2, got {vpp}")
    require(pp % 2 == 0, f"dualpipe needs an even pp; got {pp}")
    require(M % 2 == 0 and M >= 2 * pp, f"dualpipe needs an even number of microbatches >= 2*pp = {2 * pp}; got {M}")
    half, hm = pp // 2, M // 2
    base = gen_dualpipev(half, 2, hm, 0)
    place = Placement("v", pp, 2)
    ranks: dict[int, list[Slot]] = {}
    for R in range(pp):
        h = min(R, pp - 1 - R)
        s0, _ = base.placement.stages_of(h)
        down, up = R, 2 * pp - 1 - R  # this rank's vstages: down copy, up copy
        early, late = ((down, 0), (up, hm)) if R < half else ((up, hm), (down, 0))

        def remap(a: Action) -> Action:
            v, off = early if a.vstage == s0 else late
            return Action(v, a.op, a.mb + off)

        out: list[Slot] = []
        for slot in base.ranks[h]:
            if isinstance(slot, Pair):
                out.append(Pair(remap(slot.fwd), remap(slot.bwd)))
            elif slot is not None:
                out.append(remap(slot))
        ranks[R] = out
    return Schedule("dualpipe", pp, 2, M, place, ranks, bidirectional=True)


def _v_block_offsets(kind: str, pp: int, r: int) -> tuple[int, int, int, int]:
    """Start times of rank ``r``'s (F chunk 0, F chunk 1, I chunk 1, I chunk 0) in the first
    building block of V-Half / V-Min (Qi et al., 2024, "Pipeline Parallelism with Controllable
    Memory", sec. 4), in units of one chunk's F = I = W; the block repeats every 6 units. The
    gap ``delta`` keeps each rank's four offsets distinct modulo 6."""
    if kind == "v-min":
        delta = 2 if pp % 3 == 0 else 0
        return r, 2 * pp - 1 - r, 2 * pp + delta + r, 4 * pp + delta - 1 - r
    delta = 3 if pp % 2 == 0 else 0
    return 2 * r, 3 * pp - 2 - r, 3 * pp + delta + 2 * r - 1, 6 * pp + delta - 2 - r


def _v_controllable(kind: str, pp: int, vpp: int, M: int) -> Schedule:
    """V-Half / V-Min ([Note: controllable-memory V schedules]): V placement, two chunks per rank.

    Rank r places micro-batch k's F0, F1, I1, I0 at its block offsets + 6k; each weight backward
    W (chunk 1's first, then chunk 0's, oldest first per chunk) takes the next free unit after its
    I. The per-rank order is those units sorted by time; the simulator then runs every action as
    soon as its inputs allow (the paper's "squeeze"; its extra reordering pass is not applied).
    """
    require(vpp == 2, f"{kind} places two chunks per rank (V shape); needs vpp 2, got {vpp}")
    place = Placement("v", pp, 2)
    ranks: dict[int, list[Slot]] = {}
    for r in range(pp):
        s0, s1 = place.stages_of(r)
        f0, f1, i1, i0 = _v_block_offsets(kind, pp, r)
        at: dict[int, Action] = {}
        for k in range(M):
            for t, a in ((f0, Action(s0, "F", k)), (f1, Action(s1, "F", k)), (i1, Action(s1, "I", k)),
                         (i0, Action(s0, "I", k))):
                assert t + 6 * k not in at, (kind, pp, r, k)  # the offsets differ modulo 6
                at[t + 6 * k] = a
        end = max(at)
        wq: dict[int, list[Action]] = {s1: [], s0: []}
        order: list[Slot] = []
        t = 0
        while t <= end or wq[s1] or wq[s0]:
            a = at.get(t)
            if a is not None:
                order.append(a)
                if a.op == "I":
                    wq[a.vstage].append(Action(a.vstage, "W", a.mb))
            else:
                for v in (s1, s0):
                    if wq[v]:
                        order.append(wq[v].pop(0))
                        break
            t += 1
        ranks[r] = order
    return Schedule(kind, pp, 2, M, place, ranks)


def gen_v_half(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    return _v_controllable("v-half", pp, vpp, M)


def gen_v_min(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    return _v_controllable("v-min", pp, vpp, M)


def _v_one_direction(p: int, M: int) -> Schedule:
    """A one-direction V schedule with full backwards (B), p ranks, two chunks: list-scheduled on
    unit durations (F = B = 1), each free rank running its ready B of the oldest micro-batch, else
    its oldest ready F (the later chunk first on ties). The base of :func:`gen_chimera`."""
    place = Placement("v", p, 2)
    s = Schedule("v-1f1b", p, 2, M, place, {r: [] for r in range(p)})
    todo = {r: [Action(v, op, m) for v in place.stages_of(r) for m in range(M) for op in "FB"] for r in range(p)}
    done_at: dict[Action, int] = {}
    t = 0
    while any(todo.values()):
        picks: dict[int, Action] = {}
        for r in range(p):
            ready = [a for a in todo[r] if all(done_at.get(d, t + 1) <= t for d in deps_of(s, a))]
            if ready:
                picks[r] = min(ready, key=lambda a: (a.op != "B", a.mb, -a.vstage))
        for r, a in picks.items():
            todo[r].remove(a)
            s.ranks[r].append(a)
            done_at[a] = t + 1
        t += 1
    return s


def gen_chimera(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    """Chimera (Li & Hoefler, SC'21): two pipelines in opposite directions over the same pp ranks,
    on two model replicas, rank R holding stage R of the down replica and stage pp-1-R of the up
    one ([Note: dualpipe mapping]: the same 2*pp vstages; micro-batches 0..M/2-1 go down, the rest
    up). Full backwards (Chimera does not split dW). Built like :func:`gen_dualpipe`: rank R with
    h = min(R, pp-1-R) runs the rank-h order of a one-direction V schedule on pp/2 ranks with M/2
    micro-batches, its chunk 0 being R's stage in the direction where R comes early, so each
    micro-batch meets the same neighbours in the same order; with F = B that order leaves each
    rank pp-2 units idle, Chimera's published (D-2)/(2N+D-2) bubble ratio."""
    require(vpp == 2, f"chimera holds two stages per rank (two replicas); needs vpp 2, got {vpp}")
    require(pp % 2 == 0, f"chimera needs an even pp; got {pp}")
    require(M % 2 == 0, f"chimera needs an even number of microbatches (half go down, half up); got {M}")
    half, hm = pp // 2, M // 2
    base = _v_one_direction(half, hm)
    place = Placement("v", pp, 2)
    ranks: dict[int, list[Slot]] = {}
    for R in range(pp):
        h = min(R, pp - 1 - R)
        s0, _ = base.placement.stages_of(h)
        down, up = R, 2 * pp - 1 - R
        early, late = ((down, 0), (up, hm)) if R < half else ((up, hm), (down, 0))
        out: list[Slot] = []
        for slot in base.ranks[h]:
            assert isinstance(slot, Action)
            v, off = early if slot.vstage == s0 else late
            out.append(Action(v, slot.op, slot.mb + off))
        ranks[R] = out
    return Schedule("chimera", pp, 2, M, place, ranks, bidirectional=True)


def gen_pipedream_2bw(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    """PipeDream-2BW over two consecutive steps ([Note: pipedream-2bw]): 1F1B over 2M
    micro-batches, the second step's numbered M..2M-1, so step t+1's warm-up forwards fill step
    t's drain instead of waiting for a flush."""
    require(vpp == 1, f"pipedream-2bw places one stage per rank; needs vpp 1, got {vpp}")
    one = gen_1f1b(pp, vpp, 2 * M, extra)
    return Schedule("pipedream-2bw", pp, 1, 2 * M, one.placement, one.ranks)
