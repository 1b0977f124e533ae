"""The run plan: cases x impls x world sizes x data modes -> validated, frozen Cells.

Everything a rank needs is in the Cell it is handed (serialised into the launch's plan file);
a worker reads no other configuration. Every check here runs before any rank is started, so a
bad request fails with one clear line and exit code 2.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from cases.catalog import CASES, get_case, with_global_batch
from cases.data import DATA_MODES
from harness.errors import PlanError

REFERENCE_IMPL = "single"
DEFAULT_CASES = ("mlp", "transformer")
DEFAULT_IMPLS = ("ours", "fsdp2")
DEFAULT_WORLD_SIZES = (1, 2, 4, 8)
DEFAULT_DATA_MODES = None  # each case's own `data_modes`
# Rank 0 keeps every step's full parameters, gradients and shadow state in memory and in the
# snapshot, and the shadow recomputes per-sample gradients at every step: beyond this a run of
# the standard matrix takes many hours on a CPU host and its snapshots grow past memory.
MAX_STEPS = 1000
# Every rank is a process that imports torch (about 0.4 GB each) on this one host.
MAX_CPU_WORLD_SIZE = 16
# Simulated ranks are threads of one process ([Note: Simulated ranks], harness/run/simulated.py).
MAX_SIMULATED_WORLD_SIZE = 1024
BACKENDS = ("gloo", "nccl", "simulated")


@dataclass(frozen=True)
class Cell:
    """One (case, impl, world size, data mode); it trains once per optimizer of the case."""

    case: str
    impl: str  # a registered name or an import spec 'module:attr' / 'path/file.py:attr'
    world_size: int
    data_mode: str
    steps: int
    faults: tuple[str, ...] = ()
    is_reference: bool = False
    # A user's adapter ('module:Class' / 'file.py:Class'): its unique `name`, filled in by
    # build_plan, keys the cells and reports; a built-in impl is its own name.
    impl_name: str = ""
    # A reference cell: the world sizes of the cells judged against it (its perturbed runs' noise
    # covers the honest reductions of every one: harness/reference/shadow.py `_amplitude`).
    serves: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise PlanError(f"Cell world_size={self.world_size} must be >= 1")
        if self.data_mode not in DATA_MODES:
            raise PlanError(f"Cell data_mode={self.data_mode!r} is not one of {DATA_MODES}")
        if self.steps < 1:
            raise PlanError(f"Cell steps={self.steps} must be >= 1")

    @property
    def impl_label(self) -> str:
        if ":" not in self.impl:
            return self.impl
        return self.impl_name or re.sub(r"[^A-Za-z0-9_]+", "_", self.impl.rsplit(":", 1)[-1])

    @property
    def case_label(self) -> str:
        """The catalog name, or the name a user's case ('file.py:make_case') gives itself."""
        return get_case(self.case).name if ":" in self.case else self.case

    @property
    def cell_id(self) -> str:
        if self.is_reference:
            return f"ref.{self.case_label}"
        base = f"{self.case_label}.{self.impl_label}.w{self.world_size}.{self.data_mode}"
        # Cells of one launch that differ only in planted faults (the mutants verb) need their own ids.
        return base + "".join(f".{f}" for f in self.faults)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Cell:
        return cls(**{**d, "faults": tuple(d.get("faults", ())), "serves": tuple(d.get("serves", ()))})


@dataclass(frozen=True)
class Nodes:
    """The hosts a run's launches span ([Note: Across nodes] in harness/run/nodes.py): `count` nodes
    meeting at torchrun's c10d rendezvous `endpoint` (HOST:PORT) under `rdzv_id`; this process is
    node `rank` (0 runs the plan, judges and reports; the others run their ranks and exit with its
    verdict). One node: none of it applies."""

    count: int = 1
    rank: int = 0
    endpoint: str = ""
    rdzv_id: str = "harness"

    @property
    def many(self) -> bool:
        return self.count > 1

    @property
    def leads(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class RunPlan:
    cells: tuple[Cell, ...]  # the cells under test
    references: tuple[Cell, ...]  # one per case: impl=single at W = 1
    out_dir: Path
    timeout_s: float  # per world size of a launch: exactly, or the base of `timeout_for` when scaled
    threads: int = 1  # intra-op threads in every rank, equal at every world size
    launch_per_cell: bool = False  # one torchrun per cell: only to measure what batching saves
    extra_pythonpath: tuple[str, ...] = field(default_factory=tuple)
    skipped: tuple[tuple[Cell, str], ...] = ()  # cells that cannot run here, with the reason
    notes: tuple[str, ...] = ()  # what the plan could not check (printed before the run)
    backend: str = "gloo"  # gloo (CPU), nccl (one rank per GPU) or simulated (ranks as threads)
    device: str = "cpu"
    # The cases whose cells their own rank 0 judges ([Note: Judged where the evidence lives] in
    # harness/run/judged.py); the others write snapshots that the parent judges.
    judged_on_ranks: tuple[str, ...] = ()
    nodes: Nodes = Nodes()
    timeout_scaled: bool = False  # no --timeout given: `timeout_for` grows with the models' size
    # Stamped into every launch plan, snapshot, initial state and report of this run: evidence
    # carrying another id is never judged (see harness/judge/verdict.py).
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def world_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({c.world_size for c in self.cells}))

    def cells_for(self, world_size: int) -> tuple[Cell, ...]:
        # The reference cells need no process group: rank 0 of the first launch runs them (the
        # other ranks skip them), so a plan without W = 1 pays for no extra launch.
        refs = self.references if world_size == self.world_sizes[0] else ()
        return refs + tuple(c for c in self.cells if c.world_size == world_size)

    def timeout_for(self, world_size: int) -> float:
        """Seconds the cells of `world_size` get in a launch ([Note: Timeout by size])."""
        if not self.timeout_scaled:
            return self.timeout_s
        work = sum(num_parameters(c.case) * c.steps for c in self.cells_for(world_size))
        return self.timeout_s + SECONDS_PER_PARAMETER_STEP * work

    @property
    def snapshot_dir(self) -> Path:
        return self.out_dir / "snapshots"

    @property
    def init_dir(self) -> Path:
        return self.out_dir / "init"

    @property
    def log_dir(self) -> Path:
        return self.out_dir / "logs"


def parse_csv(value: str, what: str) -> tuple[str, ...]:
    """Comma-separated, strictly: no empty entry ('1,,2', 'a,'), no repeat."""
    items = tuple(v.strip() for v in value.split(","))
    if not value.strip():
        raise PlanError(f"--{what} is empty")
    if "" in items:
        raise PlanError(f"--{what}={value} has an empty entry; separate the entries by single commas")
    if len(set(items)) != len(items):
        raise PlanError(f"--{what}={value} repeats an entry")
    return items


def parse_world_sizes(value: str, flag: str = "world-sizes") -> tuple[int, ...]:
    sizes = []
    for item in parse_csv(value, flag):
        try:
            size = int(item)
        except ValueError:
            raise PlanError(f"--{flag}: {item!r} is not an integer") from None
        if size < 1:
            raise PlanError(f"--{flag}: world_size={size} must be >= 1")
        sizes.append(size)
    return tuple(sorted(sizes))


def check_world_size(size: int, flag: str, device: str = "cpu", backend: str = "gloo") -> None:
    if backend == "simulated":
        if size > MAX_SIMULATED_WORLD_SIZE:
            raise PlanError(f"{flag}: world_size={size} exceeds {MAX_SIMULATED_WORLD_SIZE}, the most simulated ranks "
                            f"this harness runs")
        return
    if device == "cpu" and size > MAX_CPU_WORLD_SIZE:
        raise PlanError(f"{flag}: world_size={size} exceeds {MAX_CPU_WORLD_SIZE}, the most ranks this harness runs "
                        f"on one CPU host (each rank is a process importing torch); use a smaller world size, or "
                        f"--backend simulated (up to {MAX_SIMULATED_WORLD_SIZE} ranks as threads of one process)")


def check_nodes(nodes: Nodes, world_sizes: tuple[int, ...], launch_per_cell: bool) -> None:
    """--nnodes, --node-rank, --rdzv-endpoint: refused before any rank starts where they cannot
    work ([Note: Across nodes] in harness/run/nodes.py)."""
    if nodes.count < 1:
        raise PlanError(f"--nnodes={nodes.count} must be >= 1")
    if not 0 <= nodes.rank < nodes.count:
        raise PlanError(f"--node-rank={nodes.rank} must be between 0 and --nnodes - 1 = {nodes.count - 1}")
    if not nodes.many:
        return
    host, _, port = nodes.endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PlanError(f"--nnodes {nodes.count} needs --rdzv-endpoint HOST:PORT (the rendezvous every node "
                        f"meets at), got {nodes.endpoint!r}")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", nodes.rdzv_id):
        raise PlanError(f"--rdzv-id={nodes.rdzv_id!r}: use letters, digits, '.', '_' and '-'")
    if launch_per_cell:
        raise PlanError("--launch-per-cell runs on one node; drop --nnodes")
    launch_size = max(world_sizes)
    if launch_size % nodes.count:
        raise PlanError(f"--nnodes {nodes.count}: the launch of {launch_size} ranks (the largest of --world-sizes) "
                        f"does not split evenly over {nodes.count} nodes")


def _cell_faults(faults: tuple[str, ...], impl: str, world_size: int) -> tuple[str, ...]:
    """impl/'s faults on impl=ours cells; collective faults on every cell with collectives (W > 1);
    the training loop's on every cell."""
    from harness.faults import of_layer, split_faults

    impl_faults, collective_faults = split_faults(faults)
    return tuple(sorted((impl_faults if impl == "ours" else set()) | (collective_faults if world_size > 1 else set())
                        | (set(faults) & of_layer("loop").keys())))


def _fault_copies(cells: list[Cell], fault_copies: tuple[str, ...]) -> list[Cell]:
    """One more copy of each cell per fault, carrying that fault besides the cell's own, where the
    fault can act (impl/'s faults on impl=ours, collective faults at W > 1): many planted bugs and
    their honest twins in one launch, each judged against the same reference. Tests use it (run
    --fault-copies) to pay start-up once for a battery of planted bugs."""
    copies = []
    for fault in fault_copies:
        for cell in cells:
            added = _cell_faults((fault,), cell.impl, cell.world_size)
            if added and fault not in cell.faults:
                copies.append(replace(cell, faults=tuple(sorted(cell.faults + added))))
    return copies


@dataclass(frozen=True)
class RunRequest:
    """What a run is asked for, as the command line gives it (harness/verbs/common.py
    `request_from_args` parses the flags once) or a caller writes it; `build_plan` checks it and
    turns it into cells."""

    cases: tuple[str, ...] = DEFAULT_CASES
    impls: tuple[str, ...] = DEFAULT_IMPLS
    world_sizes: tuple[int, ...] = DEFAULT_WORLD_SIZES
    data_modes: tuple[str, ...] | None = DEFAULT_DATA_MODES  # None: each case's own
    steps: int | None = None  # None: each case's own
    timeout_s: float | None = None  # per world size; None: DEFAULT_TIMEOUT_S scaled by size ([Note: Timeout by size])
    out_dir: str | Path = "reports"
    faults: tuple[str, ...] = ()  # planted in every cell
    fault_copies: tuple[str, ...] = ()  # one more copy of every cell per fault
    threads: int = 1  # intra-op threads in every rank
    launch_per_cell: bool = False
    backend: str = "gloo"
    device: str = "cpu"
    judge_on: str = "auto"  # JUDGE_ON
    nodes: Nodes = Nodes()


def build_plan(request: RunRequest | None = None, **fields) -> RunPlan:
    """The plan of `request` (or of a RunRequest of `fields`: `build_plan(cases=("mlp",))`), every
    flag checked before any rank starts (PlanError: one line, exit 2)."""
    request = RunRequest(**fields) if request is None else replace(request, **fields)
    cases, impls, world_sizes, data_modes = request.cases, request.impls, request.world_sizes, request.data_modes
    steps, timeout_s, out_dir, threads = request.steps, request.timeout_s, request.out_dir, request.threads
    faults, fault_copies, judge_on = request.faults, request.fault_copies, request.judge_on
    backend, device, launch_per_cell = request.backend, request.device, request.launch_per_cell
    nodes = request.nodes
    check_nodes(nodes, world_sizes, launch_per_cell)
    from harness.adapters.registry import resolve_impl  # imports torch; kept out of plain Cell use

    case_names: dict[str, str] = {}
    extra_paths = []
    for name in cases:
        try:
            case = get_case(name)
            if ":" in name:
                from cases.user import validate_case
                from harness.run.batch_makeup import split_key, splits_of
                from harness.run.isolated import (discard_child_checks, start_child_checks,
                                                  validate_case_in_a_child)

                # One child validates and measures the batch makeup `_check_cases` will ask for, if the
                # model is big (the parent holds no copy of a big model): started before the parent
                # sizes the model (a second, for a big one), ended at once where the model is small.
                splits = () if case.missing_requirements() else split_key(
                    splits_of(name, world_sizes, data_modes or case.data_modes))
                start_child_checks(name, True, splits)
                if num_parameters(name) >= JUDGE_ON_RANKS_FROM:
                    validate_case_in_a_child(name, splits)
                else:
                    discard_child_checks(name, True, splits)
                    validate_case(case, name)
        except ValueError as e:
            raise PlanError(str(e)) from None
        if case.name in case_names or (":" in name and case.name in CASES):
            other = case_names.get(case.name, f"the catalog case {case.name!r}")
            raise PlanError(f"--cases {name} is named {case.name!r} like {other}; the name keys its cells and "
                            f"initial state: give your Case another name")
        case_names[case.name] = name
        if ":" in name and not name.split(":")[0].endswith(".py"):
            extra_paths.append(os.getcwd())  # the ranks import 'module:attr' from where the run started
    for mode in data_modes or ():
        if mode not in DATA_MODES:
            raise PlanError(f"unknown data mode {mode!r}; known: {list(DATA_MODES)}")
    for w in world_sizes:
        if w < 1:
            raise PlanError(f"world_size={w} must be >= 1")
        check_world_size(w, "--world-sizes", device, backend)
    if steps is not None and not 1 <= steps <= MAX_STEPS:
        raise PlanError(f"--steps={steps} must be between 1 and {MAX_STEPS} (every step's full parameters, gradients "
                        f"and shadow state are kept as evidence)")
    if timeout_s is not None and not timeout_s > 0:
        raise PlanError(f"--timeout={timeout_s} must be > 0 seconds")
    if threads < 1:
        raise PlanError(f"threads={threads} must be >= 1")
    check_backend(backend, device, world_sizes)
    if backend == "simulated" and nodes.many:
        raise PlanError("--backend simulated runs every rank in one process on this host; drop --nnodes")
    labels: dict[str, str] = {}
    adapters = {}
    for impl in impls:
        try:
            adapter = resolve_impl(impl)
        except ValueError as e:
            raise PlanError(str(e)) from None
        except Exception as e:  # a user's adapter file with a syntax error, raising at import or in __init__
            raise PlanError(f"impl {impl!r}: loading it raised {type(e).__name__}: {_one_line(e)}; "
                            f"fix the adapter and run again") from None
        label = adapter.name
        if label in labels:
            raise PlanError(f"--impls {labels[label]} and {impl} share the name {label!r}, which keys their cells and "
                            f"reports; give one of them another `name`")
        labels[label] = impl
        adapters[impl] = adapter
        if not adapter.needs_process_group and any(w != 1 for w in world_sizes):
            raise PlanError(
                f"impl={impl} runs without a process group, so only at world_size=1; "
                f"got world sizes {list(world_sizes)}"
            )
        if impl.split(":")[0].endswith(".py"):
            extra_paths.append(str(Path(impl.split(":")[0]).resolve().parent))
    if faults or fault_copies:
        from harness.faults import check_faults, split_faults

        check_faults(faults + fault_copies, impls)
        collective = sorted(split_faults(faults + fault_copies)[1])
        if backend == "simulated" and collective:
            raise PlanError(f"--faults {collective[0]}: collective faults act at torch's ProcessGroup of real ranks, "
                            f"not on simulated ones; run them with --backend gloo")

    cases, batch_notes = _split_batches(cases, world_sizes, data_modes)
    cells, skipped = [], []
    for case_name in cases:
        case = get_case(case_name)
        modes = data_modes or case.data_modes
        for w in world_sizes:
            if w not in case.world_sizes:
                raise PlanError(f"case={case_name} does not run at world_size={w}; its world sizes: {list(case.world_sizes)}")
            for mode in modes:
                if mode not in case.data_modes:
                    why = dict(case.refused_modes).get(mode)
                    raise PlanError(f"case={case_name} refuses data mode {mode!r}: {why}" if why else
                                    f"case={case_name} has no data mode {mode!r}; its modes: {list(case.data_modes)}")
            for mode in modes:
                for impl in impls:
                    cell = Cell(case_name, impl, w, mode, steps or case.steps,
                                faults=_cell_faults(faults, impl, w),
                                impl_name=adapters[impl].name if ":" in impl else "")
                    reason = _skip_reason(case, adapters[impl], backend)
                    if reason:
                        skipped.append((cell, reason))
                    else:
                        cells.append(cell)
    notes = batch_notes + _check_cases(cases, adapters, world_sizes, data_modes)
    if not cells:
        raise PlanError("nothing to run: every requested cell is skipped: "
                        + "; ".join(sorted({f"{c.case} ({c.impl}): {r}" for c, r in skipped})))
    cells += _fault_copies(cells, fault_copies)
    references = tuple(
        Cell(name, REFERENCE_IMPL, 1, "identical", steps or get_case(name).steps, is_reference=True,
             serves=tuple(sorted({c.world_size for c in cells if c.case == name})))
        for name in cases if any(c.case == name for c in cells)
    )
    if str(out_dir).strip() == "":  # Path("") would be the current directory
        raise PlanError("--out is empty; name a directory (for example --out runs/mine)")
    ids = [c.cell_id for c in references + tuple(cells)]
    assert len(set(ids)) == len(ids), f"cell ids repeat: {sorted(i for i in set(ids) if ids.count(i) > 1)}"
    if judge_on not in JUDGE_ON:
        raise PlanError(f"--judge-on={judge_on!r} must be one of {list(JUDGE_ON)}")
    judged_on_ranks = tuple(name for name in cases if any(c.case == name for c in cells)
                            and (judge_on == "ranks" or (judge_on == "auto" and num_parameters(name) >= JUDGE_ON_RANKS_FROM)))
    if nodes.many:
        apart = sorted({c.impl for c in cells if adapters[c.impl].process_per_world})
        if apart:
            raise PlanError(f"--nnodes {nodes.count}: impl {apart[0]} needs a launch per world size, which runs on "
                            f"one node; run it without --nnodes")
    return RunPlan(tuple(cells), references, Path(out_dir), float(timeout_s or DEFAULT_TIMEOUT_S), threads,
                   launch_per_cell, tuple(dict.fromkeys(extra_paths)), tuple(skipped), notes, backend, device,
                   judged_on_ranks=judged_on_ranks, nodes=nodes, timeout_scaled=timeout_s is None)


# [Note: Timeout by size]
# A hang must end, and an honest run must not: without --timeout, the cells of a world size get
# DEFAULT_TIMEOUT_S plus SECONDS_PER_PARAMETER_STEP for every parameter x step of each of them (the
# references with the smallest world size). Measured on this project's 2-core VM (the slowest
# machine it runs on): GPT-2 small (124M parameters) at W = 2, 2 steps, its reference and ours in one
# world size, took 428 s honest and 658 s with a planted fault (every element then differs and the
# bias check sorts them all): 1.3 us per parameter, step and cell; the default allows 4x that, so a
# slower machine or a busier one still finishes, and the 600 s of small models (start-up, imports,
# the catalog's cells) stay as they were. An explicit --timeout is used as given.
DEFAULT_TIMEOUT_S = 600.0
SECONDS_PER_PARAMETER_STEP = 5e-6

JUDGE_ON = ("auto", "ranks", "parent")
# --judge-on auto: a case of this many parameters or more is judged by its cells' own rank 0
# ([Note: Judged where the evidence lives]); below it a snapshot costs less than a second lock-step
# training of the reference in every cell, and the parent's matrices are complete.
JUDGE_ON_RANKS_FROM = 1 << 20


@functools.lru_cache(maxsize=None)
def num_parameters(case_name: str) -> int:
    """The case's plain model's parameter count, built on the meta device (no memory for them);
    once per case and process (the plan asks three times, and a big model's build takes a second)."""
    return sum(p.numel() for p in get_case(case_name).build_shapes().parameters())


def _split_batches(cases: tuple[str, ...], world_sizes: tuple[int, ...], data_modes: tuple[str, ...] | None
                   ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Each case under the name it runs by here: a case whose global batch some split world size of
    the run (times its micro-batches) does not divide runs, reference included, on the least
    multiple of that batch they all divide (cases/catalog.py with_global_batch), so that
    --world-sizes 3,5,6,7 split every case evenly. Returns the names and a note per enlarged batch."""
    from cases.user import check_batch  # imports torch; kept out of plain Cell use

    names, notes = [], []
    for name in cases:
        case = get_case(name)
        if "split" not in (data_modes or case.data_modes) or "split" not in case.data_modes:
            names.append(name)
            continue
        per = case.features.batch_divisor()
        batch = math.lcm(case.global_batch, *(w * per for w in world_sizes if w in case.world_sizes))
        if batch != case.global_batch:
            name = with_global_batch(name, batch)
            try:
                check_batch(get_case(name), f"case {name}")  # make_batch honours the batch asked for
            except ValueError as e:
                raise PlanError(f"{e}; give the case a global_batch every split world size divides") from None
            notes.append(f"case={case.name}: global batch {case.global_batch} -> {batch} (runs as {name}) so that "
                         f"split data divides evenly over world sizes {list(world_sizes)}"
                         + (f" x grad_accum={per}" if per > 1 else ""))
        names.append(name)
    return tuple(names), tuple(notes)


def _check_cases(cases: tuple[str, ...], adapters: dict, world_sizes: tuple[int, ...],
                 data_modes: tuple[str, ...] | None) -> tuple[str, ...]:
    """What a case asks that the run cannot honour, refused before any rank starts: parameter
    groups that split an implementation's flat parameter, a loss that depends on how the batch is
    split ([Note: Batch makeup]). Returns the notes of what could not be checked."""
    from harness.run.batch_makeup import check_batch_makeup
    from harness.run.param_groups import check_param_groups

    notes = []
    for name in cases:
        case = get_case(name)
        check_param_groups(case, name, adapters)
        # A big model's float64 probe runs in a child process: the parent holds no model.
        notes += check_batch_makeup(name, world_sizes, data_modes or case.data_modes,
                                    isolated=num_parameters(name) >= JUDGE_ON_RANKS_FROM)
    return tuple(notes)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    if isinstance(e, SyntaxError) and e.filename:
        return f"{e.filename}:{e.lineno}: {e.msg}"
    return text[0] if text else "(no message)"


def check_backend(backend: str, device: str, world_sizes: tuple[int, ...]) -> None:
    """gloo on CPUs; nccl with one rank per visible GPU of this node."""
    if backend not in BACKENDS:
        raise PlanError(f"--backend={backend!r} must be one of {', '.join(BACKENDS)}")
    if device not in ("cpu", "cuda"):
        raise PlanError(f"--device={device!r} must be cpu or cuda")
    if backend == "nccl" and device != "cuda":
        raise PlanError("--backend nccl needs --device cuda (NCCL runs on GPUs)")
    if backend == "simulated" and device != "cpu":
        raise PlanError("--backend simulated runs its ranks as threads on the CPU; drop --device cuda")
    if device == "cuda":
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        too_big = [w for w in world_sizes if w > visible]
        if too_big:
            raise PlanError(f"--device cuda runs one rank per GPU: world sizes {too_big} exceed the "
                            f"{visible} visible GPU(s) (CUDA_VISIBLE_DEVICES); use --world-sizes up to {visible}")


def _skip_reason(case, adapter, backend: str = "gloo") -> str | None:
    """Why a cell cannot run here (a missing device, a feature the implementation lacks, simulated
    ranks it cannot run on)."""
    from harness.adapters.features import device_available

    if backend == "simulated" and not adapter.simulated_ranks:
        return (f"impl {adapter.name!r} needs real ranks: simulated ones implement torch.distributed's Python "
                f"collectives only (Adapter.simulated_ranks)")
    return device_available(case.features) or adapter.unsupported(case.features)


def usable_cores() -> int:
    """The cores this process may run on (its affinity, which a container or `taskset` narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def max_teams(plan: RunPlan) -> int:
    """How many cells of one world size a launch runs side by side, each in its own ranks
    ([Note: One launch, every world size], harness/run/orchestrate.py): on GPUs as many as the
    launch's devices hold (every rank has its own); on CPUs as many as the cores keep busy at
    plan.threads each (more would only share the same cores, and hold as many models in memory)."""
    if plan.backend == "simulated":
        return 1  # one team: the threads share one process's cores and lock
    if plan.device != "cpu":
        return 1 << 30
    return max(1, usable_cores() // plan.threads)


def write_launch_plan(path: Path, plan: RunPlan, world_size: int, cells: tuple[Cell, ...]) -> None:
    """The file a launch's ranks read: only what they need, as JSON (never pickled)."""
    payload = {
        "run_id": plan.run_id,
        "world_size": world_size,
        "threads": plan.threads,
        "backend": plan.backend,
        "device": plan.device,
        "init_dir": str(plan.init_dir.resolve()),
        "snapshot_dir": str(plan.snapshot_dir.resolve()),
        "cells": [c.to_json() for c in cells],
        "max_teams": max_teams(plan),
        "judged_on_ranks": list(plan.judged_on_ranks),
    }
    path.write_text(json.dumps(payload, indent=1))


def all_case_names() -> list[str]:
    return sorted(CASES)
