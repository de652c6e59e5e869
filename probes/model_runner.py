"""vllm.v1.worker: the model runners the capture runs on, and the attributes it reads of each.

Model Runner V1 (``vllm.v1.worker.gpu_model_runner``) keeps the batch in ``model_runner.input_batch``, whose rows
requests keep from step to step (moved by ``condense``/``swap_states``). Model Runner V2 (``vllm.v1.worker.gpu``, from
vLLM 0.12.0) builds a fresh ``InputBatch`` for every step in ``prepare_inputs`` and orders its requests its own way
(fewest scheduled tokens first); nothing outside ``execute_model`` holds it. The V2 facts below are what
vllm-compat's V2 capture path relies on (``vllm_compat.batch_order``, adapters/model_runner.py): each is ``absent``
where the release has no V2 (nothing to rely on, accepted), ``baseline`` where it holds.
"""

from __future__ import annotations

import ast

from vllm_compat.probes._kit import LINES, evidence, parse_source

from vllm_compat.apiview import ApiView
from vllm_compat.findings import BASELINE, Observation, probe

RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
BATCH = "vllm.v1.worker.gpu_input_batch.InputBatch"
V1_MODULE = "vllm.v1.worker.gpu_model_runner"
ABSENT = "absent"

V2_MODULE = "vllm.v1.worker.gpu.model_runner"
V2_RUNNER = f"{V2_MODULE}.GPUModelRunner"
V2_BATCH = "vllm.v1.worker.gpu.input_batch.InputBatch"
V2_STATES = "vllm.v1.worker.gpu.states.RequestState"
V2_BATCH_FIELDS = ("req_ids", "num_reqs", "num_scheduled_tokens", "query_start_loc_np")
V2_EXPECTED = "no Model Runner V2, or one that has this (what vllm-compat's V2 capture path reads)"


@probe(
    "model_runner.v1_attributes",
    symbol=f"{RUNNER}.input_batch",
    summary="the V1 runner has model, input_batch.req_ids/req_id_to_index/num_reqs and execute_model()",
    expected=dict.fromkeys(LINES, "model_runner.model and model_runner.input_batch.req_id_to_index exist"),
)
def v1_attributes(view: ApiView) -> Observation:
    if not view.has_module(V1_MODULE):
        return Observation(ABSENT, f"Model Runner V1 is gone: there is no {V1_MODULE}")
    parsed = parse_source(view, f"{RUNNER}.__init__")
    if parsed is None:
        return Observation.unknown(f"{RUNNER}.__init__ is not readable")
    _tree, loc = parsed
    text = view.source(f"{RUNNER}.__init__").text  # type: ignore[union-attr]
    batch_init = view.source(f"{BATCH}.__init__")
    batch_text = (batch_init.text if batch_init else "") + " ".join(view.members(BATCH) or ())
    missing = [f"self.{a}" for a in ("input_batch",) if f"self.{a}" not in text]
    missing += [f"InputBatch.{m}" for m in ("req_ids", "req_id_to_index", "num_reqs") if m not in batch_text]
    if view.locate(f"{RUNNER}.load_model") is None:
        missing.append("load_model (which sets self.model)")
    params = [p.name for p in view.parameters(f"{RUNNER}.execute_model") or ()]
    if not params or params[0] != "scheduler_output":
        missing.append("execute_model(scheduler_output, ...)")
    if missing:
        return Observation("changed", "missing: " + ", ".join(missing), (evidence(loc),))
    return Observation(
        BASELINE,
        "input_batch, InputBatch.req_ids/req_id_to_index/num_reqs, execute_model (scheduler_output, ...)",
        (evidence(loc), evidence(view.locate(BATCH))),
    )


def _calls_of(tree: ast.AST, owner: str, name: str) -> list[ast.Call]:
    """Calls ``owner.name(...)`` in ``tree`` (``self.prepare_inputs(...)``), in source order."""
    found = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == name
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == owner
    ]
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def _batch_built_in_prepare_inputs(view: ApiView) -> tuple[ast.Call | None, ast.AST | None]:
    """The ``InputBatch(req_ids=..., num_scheduled_tokens=..., ...)`` call in V2's ``prepare_inputs``, and its AST."""
    parsed = parse_source(view, f"{V2_RUNNER}.prepare_inputs")
    if parsed is None:
        return None, None
    tree = parsed[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "InputBatch":
            return node, tree
    return None, tree


@probe(
    "model_runner.v2_step_batch",
    symbol=f"{V2_RUNNER}.prepare_inputs",
    summary="V2 builds each step's InputBatch in prepare_inputs(scheduler_output, ...), with the requests in row order",
    expected=dict.fromkeys(LINES, V2_EXPECTED),
    accepts={key: {BASELINE, ABSENT} for key in LINES},
)
def v2_step_batch(view: ApiView) -> Observation:
    """Where the V2 path reads a step's layout: the InputBatch that ``execute_model`` gets from ``prepare_inputs``."""
    if not view.has_module(V2_MODULE):
        return Observation(ABSENT, "no Model Runner V2 in this release")
    loc = view.locate(f"{V2_RUNNER}.prepare_inputs")
    params = [p.name for p in view.parameters(f"{V2_RUNNER}.prepare_inputs") or ()]
    execute = parse_source(view, f"{V2_RUNNER}.execute_model")
    fields = [p.name for p in view.parameters(V2_BATCH) or ()]
    if loc is None or execute is None or not fields:
        return Observation.unknown(f"{V2_RUNNER}.prepare_inputs, .execute_model or {V2_BATCH} is not readable")
    built, _tree = _batch_built_in_prepare_inputs(view)
    keywords = {k.arg for k in built.keywords} if built is not None else set()
    problems = []
    if not params or params[0] != "scheduler_output":
        problems.append(f"prepare_inputs takes ({', '.join(params)}), not (scheduler_output, ...)")
    if len(_calls_of(execute[0], "self", "prepare_inputs")) != 1:
        problems.append("execute_model does not call self.prepare_inputs(...) exactly once")
    problems += [f"InputBatch has no {f}" for f in V2_BATCH_FIELDS if f not in fields]
    problems += [
        f"prepare_inputs builds no InputBatch({k}=...)"
        for k in ("req_ids", "num_scheduled_tokens")
        if k not in keywords
    ]
    where = (
        evidence(loc, "builds InputBatch(req_ids=, num_scheduled_tokens=, ...)"),
        evidence(execute[1]),
        evidence(view.locate(V2_BATCH), ", ".join(f for f in V2_BATCH_FIELDS if f in fields)),
    )
    if problems:
        return Observation("changed", "; ".join(problems), where)
    return Observation(
        BASELINE,
        "execute_model calls self.prepare_inputs(scheduler_output, ...) once per step; the InputBatch it returns "
        "names the step's requests in row order (req_ids, num_scheduled_tokens, query_start_loc_np)",
        where,
    )


@probe(
    "model_runner.v2_row_layout",
    symbol=f"{V2_RUNNER}.prepare_inputs",
    summary="V2 lays a step's tokens out request after request, in InputBatch.req_ids order",
    expected=dict.fromkeys(LINES, V2_EXPECTED),
    accepts={key: {BASELINE, ABSENT} for key in LINES},
)
def v2_row_layout(view: ApiView) -> Observation:
    """The batch's ``query_start_loc_np`` is the running sum of per-request token counts in ``req_ids`` order: request
    i has rows [query_start_loc[i], query_start_loc[i + 1]) of every per-token tensor of the forward. (From 0.28 the
    batch's ``num_scheduled_tokens`` may be an upper bound under adaptive draft verification; the layout is
    ``query_start_loc_np``, which vllm-compat reads, and checks against the scheduler's counts.)"""
    if not view.has_module(V2_MODULE):
        return Observation(ABSENT, "no Model Runner V2 in this release")
    built, tree = _batch_built_in_prepare_inputs(view)
    loc = view.locate(f"{V2_RUNNER}.prepare_inputs")
    if tree is None:
        return Observation.unknown(f"{V2_RUNNER}.prepare_inputs is not readable")
    given = {k.arg: k.value for k in built.keywords} if built is not None else {}
    if "query_start_loc_np" not in given or "req_ids" not in given:
        return Observation(
            "changed", "prepare_inputs builds no InputBatch(req_ids=..., query_start_loc_np=...)", (evidence(loc),)
        )
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "cumsum"
            and node.args
            and isinstance(node.args[0], ast.Name)
            and "num_scheduled_tokens" in node.args[0].id
            and any(k.arg == "out" and "query_start_loc" in ast.unparse(k.value) for k in node.keywords)
        ):
            return Observation(
                BASELINE,
                f"query_start_loc = {ast.unparse(node)}, the token counts in req_ids order: each request's tokens "
                "are one contiguous run of rows, in batch order",
                (evidence(loc, ast.unparse(node)),),
            )
    return Observation(
        "changed",
        "prepare_inputs does not compute query_start_loc as the running sum of the scheduled token counts",
        (evidence(loc),),
    )


@probe(
    "model_runner.v2_eager_forward",
    symbol=f"{V2_RUNNER}.execute_model",
    summary="with CUDA graphs off, V2 runs the model module itself, after the step's batch is built",
    expected=dict.fromkeys(LINES, V2_EXPECTED),
    accepts={key: {BASELINE, ABSENT} for key in LINES},
)
def v2_eager_forward(view: ApiView) -> Observation:
    """speculators replaces the base model's ``forward`` on the instance; V2 must call the module (``self.model(...)``)
    so that forward runs, and only after ``prepare_inputs``, so the step's layout is known when it captures."""
    if not view.has_module(V2_MODULE):
        return Observation(ABSENT, "no Model Runner V2 in this release")
    execute = parse_source(view, f"{V2_RUNNER}.execute_model")
    if execute is None:
        return Observation.unknown(f"{V2_RUNNER}.execute_model is not readable")
    tree, loc = execute
    forwards = _calls_of(tree, "self", "model")
    prepared = _calls_of(tree, "self", "prepare_inputs")
    if not forwards:
        return Observation("changed", "execute_model never calls self.model(...)", (evidence(loc),))
    if not prepared or not any(f.lineno > prepared[0].lineno for f in forwards):
        return Observation(
            "changed", "execute_model calls self.model(...) before self.prepare_inputs(...)", (evidence(loc),)
        )
    return Observation(
        BASELINE,
        f"execute_model calls {ast.unparse(forwards[-1])} after self.prepare_inputs(...) (eager mode: "
        "enforce_eager=True, as speculators sets it)",
        (evidence(loc),),
    )


@probe(
    "model_runner.v2_request_states",
    symbol=f"{V2_STATES}.req_id_to_index",
    summary="V2 keeps its live requests in req_states.req_id_to_index and drops finished ones",
    expected=dict.fromkeys(LINES, V2_EXPECTED),
    accepts={key: {BASELINE, ABSENT} for key in LINES},
)
def v2_request_states(view: ApiView) -> Observation:
    """Tells a scheduled step from a dummy forward (warm-up, profiling: its requests are not in ``req_states``), and
    frees the slots of requests speculators aborts (``finished_req_ids``)."""
    if not view.has_module(V2_MODULE):
        return Observation(ABSENT, "no Model Runner V2 in this release")
    init = view.source(f"{V2_RUNNER}.__init__")
    states = view.source(f"{V2_STATES}.__init__")
    runner = view.source(V2_RUNNER)
    if init is None or states is None or runner is None:
        return Observation.unknown(f"{V2_RUNNER} or {V2_STATES} is not readable")
    problems = []
    if "self.req_states" not in init.text:
        problems.append("GPUModelRunner.__init__ sets no self.req_states")
    if "self.req_id_to_index" not in states.text:
        problems.append("RequestState has no req_id_to_index")
    if view.locate(f"{V2_STATES}.remove_request") is None or "finished_req_ids" not in runner.text:
        problems.append("finished requests are not removed (no RequestState.remove_request or finished_req_ids)")
    where = (
        evidence(view.locate(f"{V2_RUNNER}.__init__"), "self.req_states"),
        evidence(view.locate(f"{V2_STATES}.__init__"), "self.req_id_to_index"),
    )
    if problems:
        return Observation("changed", "; ".join(problems), where)
    return Observation(
        BASELINE,
        "req_states.req_id_to_index holds the requests the runner was given (scheduled_new_reqs) until "
        "finished_req_ids removes them",
        where,
    )


_FREEING_LOOPS = ("finished_req_ids", "preempted_req_ids")  # what a step tells the runner to forget


def _self_call(node: ast.AST, *path: str) -> bool:
    """Whether ``node`` is a call of ``self.<path...>(...)`` (``self.req_states.remove_request(...)``)."""
    if not isinstance(node, ast.Call):
        return False
    func: ast.AST = node.func
    for name in reversed(path):
        if not isinstance(func, ast.Attribute) or func.attr != name:
            return False
        func = func.value
    return isinstance(func, ast.Name) and func.id == "self"


def _slot_releases(runner_tree: ast.AST) -> tuple[list[str], list[str], dict[str, int], dict[str, int]]:
    """Where V2's runner frees and takes request slots.

    Returns (the loops that free slots, named by what they iterate; frees outside such a loop; method -> line of its
    first freeing loop; method -> line of its first ``self.req_states.add_request``). A free is
    ``self.req_states.remove_request(...)`` or ``self._remove_request(...)``; it is accounted for inside ``for`` over
    something named ``finished_req_ids`` or ``preempted_req_ids`` (what the scheduler output lists), inside ``for``
    over ``scheduled_new_reqs`` (a request re-added at once: no slot changes hands), or as the body of
    ``_remove_request`` itself.
    """
    loops: list[str] = []
    stray: list[str] = []
    frees_at: dict[str, int] = {}
    adds_at: dict[str, int] = {}

    def visit(node: ast.AST, method: str, iterating: tuple[str, ...]) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            method, iterating = node.name, ()
        if isinstance(node, ast.For):
            iterating = (*iterating, ast.unparse(node.iter))
        if _self_call(node, "req_states", "add_request"):
            adds_at.setdefault(method, node.lineno)  # type: ignore[attr-defined]
        if _self_call(node, "req_states", "remove_request") or _self_call(node, "_remove_request"):
            over = [it for it in iterating if any(name in it for name in _FREEING_LOOPS)]
            if over:
                loops.append(f"{method}: for ... in {over[-1]}")
                frees_at.setdefault(method, node.lineno)  # type: ignore[attr-defined]
            elif not (
                any("scheduled_new_reqs" in it for it in iterating)
                or (method == "_remove_request" and _self_call(node, "req_states", "remove_request"))
            ):
                stray.append(f"{method} (line {node.lineno} of the class)")  # type: ignore[attr-defined]
        for child in ast.iter_child_nodes(node):
            visit(child, method, iterating)

    visit(runner_tree, "", ())
    return loops, stray, frees_at, adds_at


@probe(
    "model_runner.v2_request_slots",
    symbol=f"{V2_STATES}.add_request",
    summary="V2 holds a fixed pool of request slots, each freed only when a step it runs lists its request as finished",
    expected=dict.fromkeys(LINES, V2_EXPECTED),
    accepts={key: {BASELINE, ABSENT} for key in LINES},
)
def v2_request_slots(view: ApiView) -> Observation:
    """Model Runner V2 gives each request a slot from a fixed pool (``RequestState.free_indices``, ``max_num_reqs`` =
    the scheduler's ``max_num_seqs``) when it first runs, and takes it back only when a scheduler output it executes
    lists the request in ``finished_req_ids`` (or ``preempted_req_ids``), before that step's new requests take theirs.
    A request the scheduler finished whose id never reaches the runner in a step keeps its slot for good, and once the
    pool is empty ``add_request`` fails (``AssertionError: No free indices``). Model Runner V1 has no such pool (it
    drops unscheduled requests from its batch every step). speculators 0.3.0's loop ends on a scheduler output with
    nothing to run and never sends it, and that output carries the ids of the requests it finished after its last
    step (``finished-ids-to-next-step`` keeps them for the next step)."""
    if not view.has_module(V2_MODULE):
        return Observation(ABSENT, "no Model Runner V2 in this release")
    init = parse_source(view, f"{V2_STATES}.__init__")
    add = parse_source(view, f"{V2_STATES}.add_request")
    remove = parse_source(view, f"{V2_STATES}.remove_request")
    runner = parse_source(view, V2_RUNNER)
    execute = parse_source(view, f"{V2_RUNNER}.execute_model")
    if None in (init, add, remove, runner, execute):
        return Observation.unknown(
            f"{V2_STATES} (__init__, add_request, remove_request) or {V2_RUNNER} (execute_model) is not readable"
        )
    assert init and add and remove and runner and execute  # for the type checker
    pool = next(
        (
            ast.unparse(node.value)
            for node in ast.walk(init[0])
            if isinstance(node, ast.Assign)
            and any(ast.unparse(t) == "self.free_indices" for t in node.targets)
            and ast.unparse(node.value).startswith("list(range(")
        ),
        None,
    )
    takes = [n for n in ast.walk(add[0]) if _self_call(n, "free_indices", "pop")]
    gives = [n for n in ast.walk(remove[0]) if _self_call(n, "free_indices", "append")]
    loops, stray, frees_at, adds_at = _slot_releases(runner[0])
    where = [
        evidence(add[1], "takes a slot: self.free_indices.pop(), 'No free indices' once none is left"),
        evidence(init[1], f"self.free_indices = {pool}" if pool else "self.free_indices"),
    ]
    problems = []
    if pool is None:
        problems.append("RequestState.__init__ sets no fixed pool self.free_indices = list(range(...))")
    if not takes or not gives:
        problems.append("RequestState.add_request/remove_request do not take/give back self.free_indices")
    if not loops:
        problems.append("the runner frees no slot in a loop over the step's finished_req_ids/preempted_req_ids")
    if stray:
        problems.append("the runner also frees slots elsewhere: " + ", ".join(stray))
    order = _frees_before_adds(execute[0], frees_at, adds_at)
    if order is None:
        problems.append("cannot tell whether a step frees its finished requests' slots before it adds its new ones")
    elif not order:
        problems.append("a step adds its new requests before it frees its finished requests' slots")
    freeing = next(iter(frees_at), "")
    if freeing:
        where.append(evidence(view.locate(f"{V2_RUNNER}.{freeing}"), "; ".join(dict.fromkeys(loops))))
    if problems:
        return Observation("changed", "; ".join(problems), tuple(where))
    return Observation(
        BASELINE,
        f"a fixed pool of request slots ({pool}); a slot is freed only when a step the runner executes lists its "
        "request in finished_req_ids or preempted_req_ids, before that step's new requests take theirs",
        tuple(where),
    )


def _frees_before_adds(execute: ast.AST, frees_at: dict[str, int], adds_at: dict[str, int]) -> bool | None:
    """Whether a step frees finished requests' slots before it adds new requests (None: cannot tell).

    Either one method does both (the freeing loop comes first: 0.12's ``update_states``), or ``execute_model`` calls
    the freeing method before the adding one (``finish_requests`` then ``add_requests``)."""
    if not frees_at or not adds_at:
        return None
    for method, line in frees_at.items():
        if method in adds_at:
            return line < adds_at[method]
    calls = {
        node.func.attr: node.lineno
        for node in sorted(ast.walk(execute), key=lambda n: getattr(n, "lineno", 0), reverse=True)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    }  # method -> line of its first call
    free_call = [calls[m] for m in frees_at if m in calls]
    add_call = [calls[m] for m in adds_at if m in calls]
    if not free_call or not add_call:
        return None
    return min(free_call) < min(add_call)


V2_WORKER = "vllm.v1.worker.gpu_worker.Worker"
WORKER_PROC = "vllm.v1.executor.multiproc_executor.WorkerProc"


@probe(
    "model_runner.v2_async_output",
    symbol=f"{WORKER_PROC}.handle_output",
    summary="under Model Runner V2, async scheduling only moves each worker's wait for a step's output to a thread",
    expected=dict.fromkeys(LINES, "no Model Runner V2, or one that async scheduling leaves as it is"),
    accepts={key: {BASELINE, ABSENT, "changed"} for key in LINES},
)
def v2_async_output(view: ApiView) -> Observation:
    """What ``SchedulerConfig.async_scheduling`` changes in a worker that runs Model Runner V2.

    Model Runner V2 always copies a step's output off the GPU asynchronously; neither it nor the GPU worker reads
    the flag. The worker process reads it: off, its busy loop waits for each step's output before it reads the next
    RPC (the GPU idles while the next step is prepared); on, vLLM's output thread waits and the loop goes on, as in
    vLLM's own engine. ``async-output-under-v2`` leaves the flag on where this holds; where the runner or the worker
    reads the flag (``changed``), it stays off (drift here costs speed, not correctness, so it is never refused)."""
    if not view.has_module(V2_MODULE):
        return Observation(ABSENT, "no Model Runner V2 in this release")
    runner = parse_source(view, V2_RUNNER)
    worker = parse_source(view, V2_WORKER)
    proc = parse_source(view, WORKER_PROC)
    if None in (runner, worker, proc):
        return Observation.unknown(f"{V2_RUNNER}, {V2_WORKER} or {WORKER_PROC} is not readable")
    assert runner and worker and proc  # for the type checker
    readers = [
        name for name, (tree, _) in ((V2_RUNNER, runner), (V2_WORKER, worker)) if _reads(tree, "async_scheduling")
    ]
    methods = {n.name: n for n in ast.walk(proc[0]) if isinstance(n, ast.FunctionDef)}
    handle, init = methods.get("handle_output"), methods.get("__init__")
    threaded = (
        handle is not None
        and init is not None
        and _reads(handle, "use_async_scheduling")
        and "async_output_busy_loop" in methods
        and _reads(init, "async_scheduling")
    )
    where = (
        evidence(proc[1], "handle_output: the step's output to vLLM's output thread where async scheduling is on"),
    )
    problems = []
    if readers:
        problems.append(f"{', '.join(readers)} read async_scheduling: what it changes there is not known")
    if not threaded:
        problems.append("WorkerProc does not hand a step's output to an output thread under async scheduling")
    if problems:
        return Observation("changed", "; ".join(problems), where)
    return Observation(
        BASELINE,
        "Model Runner V2 and the GPU worker do not read async_scheduling; WorkerProc waits for a step's output in "
        "its output thread where it is on, in its busy loop where it is off",
        where,
    )


def _reads(tree: ast.AST, attribute: str) -> bool:
    """Whether ``tree`` reads an attribute named ``attribute`` anywhere (``x.async_scheduling``)."""
    return any(isinstance(n, ast.Attribute) and n.attr == attribute for n in ast.walk(tree))
