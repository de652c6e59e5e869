"""Adapters that keep bad input to ``generate()`` from breaking the engine speculators drives by hand."""

from __future__ import annotations

import logging
import numbers
import os
import traceback
from types import ModuleType
from typing import Any

from vllm_compat.adapters._kit import GENERATOR_MODULE

from vllm_compat.adapter import Adapter

logger = logging.getLogger("vllm_compat")
WHERE = "VllmHiddenStatesGenerator.generate(token_ids)"


class GenerateChecks(Adapter):
    """Check ``generate()``'s input before any request reaches vLLM; clean up after a failed call; say when the
    engine is gone.

    What broke (speculators defects, on every vLLM): ``generate()`` hands its input to vLLM's scheduler unchecked. An
    empty sequence, alone or in a batch, trips ``assert num_new_tokens > 0`` in ``Scheduler.schedule()``; the request
    stays queued, so every later call fails the same way and the generator is unusable. Token ids outside the
    vocabulary, floats, a flat list or a tensor of the wrong rank fail with a bare ``AssertionError`` or ``'int'
    object is not subscriptable``. Any call that fails after its requests were added leaves them in the scheduler,
    which poisons the calls after it. And once a worker process died, vLLM's executor is shut down and each call
    fails with ``AssertionError: collective_rpc should not be called on follower node``.
    Where fixed: around ``generate()``. The input is checked first (a ValueError or TypeError naming the sequence,
    position and value); valid input is passed on unchanged, including a sequence longer than ``max_model_len - 1``,
    which speculators truncates, except that tuples of ids become lists, as vLLM's ``Request`` needs (a tuple
    failed inside vLLM with AttributeError). If the call fails anyway, the requests it added are aborted, so the
    next call starts from a clean scheduler; if it failed because the executor is gone, a RuntimeError says so.
    """

    id = "generate-checks"
    always = "a speculators defect: generate() passes unchecked input to vLLM's scheduler"
    target = GENERATOR_MODULE
    remove_when = "speculators validates generate()'s input and cleans up after a failure (or >= 0.5)"

    def apply(self, module: ModuleType) -> None:
        def generate(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if executor_gone(instance):
                raise RuntimeError(f"{WHERE}: {GONE}")
            token_ids = kwargs["token_ids"] if "token_ids" in kwargs else args[0] if args else None
            check_token_ids(token_ids, vocab_size(instance))
            as_lists = tuples_as_lists(token_ids)
            if as_lists is not token_ids:  # vLLM's Request needs a list: tuples failed deep inside with AttributeError
                if "token_ids" in kwargs:
                    kwargs = {**kwargs, "token_ids": as_lists}
                else:
                    args = (as_lists, *args[1:])
            call = getattr(instance, "_request_counter", None)
            try:
                return wrapped(*args, **kwargs)
            except Exception as exc:
                if executor_gone(instance):
                    raise RuntimeError(f"{WHERE} failed: {GONE}") from exc
                if isinstance(call, int):
                    abort_leftovers(instance, call)
                raise

        self.wrap(module, "VllmHiddenStatesGenerator.generate", generate)


GONE = (
    "vLLM's executor is shut down (a worker process died, or executor.shutdown() was called), so this generator "
    "cannot run again. Create a new VllmHiddenStatesGenerator; the log above names the worker that died."
)


def executor_gone(generator: Any) -> bool:
    executor = getattr(generator, "__dict__", {}).get("executor")
    return executor is not None and bool(
        getattr(executor, "is_failed", False) or getattr(executor, "shutting_down", False)
    )


class ConstructorChecks(Adapter):
    """Check the generator's arguments before any worker starts, and stop the workers if the constructor fails.

    What broke (a speculators defect, on every vLLM): an empty ``layer_ids`` or one holding a non-integer (``[1.5]``)
    passes speculators' range check and fails only after the model loaded; speculators' default layers
    ``[2, n // 2, n - 3, n - 1]`` on a model of fewer than 3 layers fail with "Layer index 2 out of bounds [0, 1]",
    naming a layer the caller never asked for; a local ``model_path`` that does not exist fails inside
    huggingface_hub with "Repo id must be in the form 'repo_name' or 'namespace/repo_name'". And a constructor that
    fails after ``MultiprocExecutor`` started (KV-cache planning, say) leaves the workers running until the
    half-built generator is garbage-collected, which a caller holding the exception (and so its traceback) delays
    indefinitely. Tensor parallel on vLLM's CPU build, on a machine with fewer NUMA nodes than ranks (one, on most
    laptops, VMs and containers), stops with vLLM's ``AssertionError: Not enough allowed NUMA nodes to bind threads``
    under vllm-compat's wrapper frames, and nothing names the variable that fixes it.
    Where fixed: around the constructor: bad layer ids, a default that does not fit the model and a missing local
    folder raise before anything loads; on any failure after the executor started, the executor is shut down
    before the error propagates; vLLM's NUMA-binding assertion becomes a RuntimeError that names
    ``VLLM_CPU_OMP_THREADS_BIND`` first and vLLM's frame that raised (vLLM 0.20.0 on asserts in the generator's
    process, in ``vllm/utils/ompmultiprocessing.py``; earlier releases in the worker, where this cannot reach).
    Repeated and unsorted layer ids are valid requests: ``states-per-requested-layer``
    returns one state per id, in the order asked.
    """

    id = "constructor-checks"
    always = "a speculators defect: the constructor's arguments are checked late and its workers outlive a failure"
    target = GENERATOR_MODULE
    remove_when = "speculators checks its arguments and cleans up a failed constructor (or >= 0.5)"

    def apply(self, module: ModuleType) -> None:
        def init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            model_path = kwargs.get("model_path", args[0] if args else None)
            layer_ids = kwargs.get("layer_ids", args[1] if len(args) > 1 else None)
            check_model_path(model_path)
            check_layer_ids(layer_ids)
            if isinstance(layer_ids, tuple):  # accepted as a list is, and handed on as one
                if "layer_ids" in kwargs:
                    kwargs = {**kwargs, "layer_ids": list(layer_ids)}
                else:
                    args = (args[0], list(layer_ids), *args[2:])
            try:
                return wrapped(*args, **kwargs)
            except ValueError as exc:
                if layer_ids is None and default_does_not_fit(getattr(instance, "__dict__", {}).get("layer_ids")):
                    raise ValueError(default_layers_do_not_fit(instance.layer_ids, exc)) from exc
                shut_down_and_note(instance, exc)
                raise
            except BaseException as exc:
                shut_down_and_note(instance, exc)
                if isinstance(exc, AssertionError) and NUMA_BINDING in str(exc):
                    raise RuntimeError(cpu_binding_message(exc)) from exc
                raise

        self.wrap(module, "VllmHiddenStatesGenerator.__init__", init)


NUMA_BINDING = "NUMA nodes to bind threads"  # vLLM's assertion when its CPU ranks outnumber the NUMA nodes allowed


def cpu_binding_message(error: BaseException) -> str:
    """What to do when vLLM's CPU build could not bind each rank's threads to a NUMA node of its own, naming the
    variable first and vLLM's frame that raised (a reader of the traceback otherwise sees vllm-compat's wrappers)."""
    frame = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    where = ""
    if frame:
        file = frame[0].filename.replace("\\", "/")
        file = "vllm/" + file.rsplit("/vllm/", 1)[1] if "/vllm/" in file else os.path.basename(file)
        where = f" in {file}:{frame[0].lineno} ({frame[0].name})"
    return (
        "Set VLLM_CPU_OMP_THREADS_BIND: vLLM's CPU build binds each tensor-parallel rank's threads to a NUMA node of "
        f"its own, and this machine allows fewer NUMA nodes than ranks (vLLM's assertion{where}: {error}). Name "
        'each rank\'s cores, one list per rank separated by "|" (VLLM_CPU_OMP_THREADS_BIND="0-3|4-7"; "0|1" on 2 '
        'cores), or set it to "nobind"; see docs/limits.md. This stopped vLLM before the model loaded.'
    )


def default_does_not_fit(default: Any) -> bool:
    """Whether speculators' default ``[2, n // 2, n - 3, n - 1]`` (``default``) names layers the model lacks: n < 3."""
    return isinstance(default, list) and len(default) == 4 and _is_int(default[-1]) and default[-1] + 1 < 3


def default_layers_do_not_fit(default: list[int], error: Exception) -> str:
    """The message for speculators' default layers on a model too shallow for them (speculators' own check said
    ``error``). The default is ``[2, n // 2, n - 3, n - 1]``, so its last id tells the model's depth."""
    layers = default[-1] + 1
    return (
        f"VllmHiddenStatesGenerator(layer_ids=None): speculators' default layers [2, n // 2, n - 3, n - 1] are "
        f"{default} for this {layers}-layer model, and need a model of at least 3 layers ({error}). Pass layer_ids, "
        f"e.g. layer_ids={list(range(layers))}."
    )


def shut_down_and_note(instance: Any, exc: BaseException) -> None:
    if shut_down_executor(instance) and hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(
            "vllm-compat: the generator's constructor failed after vLLM's workers had started; they were shut down."
        )


def check_model_path(model_path: Any) -> None:
    """A local path (absolute, ``./``, ``../``, ``~``) must exist; a hub id (``org/name``) is left to transformers."""
    if not isinstance(model_path, str | os.PathLike):
        return
    text = os.fspath(model_path)
    local = os.path.isabs(text) or text.startswith(("./", "../", "~", ".\\", "..\\"))
    if local and not os.path.exists(os.path.expanduser(text)):
        raise FileNotFoundError(
            f"VllmHiddenStatesGenerator(model_path={text!r}): no such file or folder. Pass a local model folder "
            "or a Hugging Face model id (org/name)."
        )


def check_layer_ids(layer_ids: Any) -> None:
    """Layer ids must be a non-empty list (or tuple) of ints; speculators checks their range itself.

    An empty list or a float passed speculators' own check and failed only after the model loaded. Repeated and
    unsorted ids are served as asked (``states-per-requested-layer``).
    """
    if layer_ids is None:
        return  # speculators picks its default layers (a default that does not fit the model: see the wrapper)
    where = f"VllmHiddenStatesGenerator(layer_ids={layer_ids!r:.80})"
    if not isinstance(layer_ids, list | tuple):
        raise ValueError(f"{where}: layer_ids must be a list of ints (layer indices), not {type(layer_ids).__name__}")
    if not layer_ids:
        raise ValueError(f"{where}: no layer requested; pass at least one layer index, or None for the default layers")
    for position, layer in enumerate(layer_ids):
        if not _is_int(layer):
            raise ValueError(
                f"{where}: item {position} is {layer!r:.40} ({type(layer).__name__}), not a layer index; "
                "layer ids must be ints"
            )


def shut_down_executor(generator: Any) -> bool:
    """Shut down the executor a failed constructor started; whether there was one."""
    executor = getattr(generator, "__dict__", {}).get("executor")
    if executor is None:
        return False
    try:
        executor.shutdown()
        logger.info("vllm-compat: shut the executor down after the generator's constructor failed")
    except Exception:
        logger.warning("vllm-compat: could not shut the executor down after a failed constructor", exc_info=True)
    return True


def vocab_size(generator: Any) -> int | None:
    try:
        return int(generator.vllm_config.model_config.get_vocab_size())
    except Exception:  # an unknown config shape: skip the range check rather than guess
        return None


def check_token_ids(token_ids: Any, vocab: int | None) -> None:
    """Raise ValueError/TypeError unless ``token_ids`` is a non-empty batch of non-empty sequences of valid ids."""
    torch = _torch()
    if torch is not None and isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 2:
            raise ValueError(
                f"{WHERE}: a tensor of token ids must have shape [batch, seq_len]; got shape {tuple(token_ids.shape)}"
            )
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
            raise TypeError(f"{WHERE}: a tensor of token ids must have an integer dtype; got {token_ids.dtype}")
        if token_ids.shape[0] == 0:
            raise ValueError(f"{WHERE}: the batch is empty (shape {tuple(token_ids.shape)}); pass a sequence")
        if token_ids.shape[1] == 0:
            raise ValueError(f"{WHERE}: the sequences are empty (shape {tuple(token_ids.shape)}); vLLM needs a token")
        low, high = int(token_ids.min()), int(token_ids.max())
        if low < 0 or (vocab is not None and high >= vocab):  # find and name the offending sequence
            for i, row in enumerate(token_ids):
                _check_range(i, row.tolist(), vocab)
        return
    if not isinstance(token_ids, list | tuple):
        raise TypeError(f"{WHERE}: expected list[list[int]] or a 2-D tensor; got {type(token_ids).__name__}")
    if not token_ids:
        raise ValueError(f"{WHERE}: the batch is empty; pass at least one sequence of token ids")
    for i, seq in enumerate(token_ids):
        if torch is not None and isinstance(seq, torch.Tensor):
            if seq.dim() != 1 or seq.dtype.is_floating_point or seq.dtype.is_complex or seq.dtype == torch.bool:
                raise TypeError(
                    f"{WHERE}: sequence {i} is a tensor of shape {tuple(seq.shape)} and dtype {seq.dtype}; "
                    "each sequence must be a 1-D integer tensor or a list of ints"
                )
            seq = seq.tolist()
        if not isinstance(seq, list | tuple):
            hint = " (a single sequence must be wrapped in a list: generate([ids]))" if _is_int(seq) else ""
            raise TypeError(f"{WHERE}: item {i} is {seq!r:.60} ({type(seq).__name__}), not a sequence{hint}")
        if not seq:
            raise ValueError(
                f"{WHERE}: sequence {i} is empty; every sequence needs at least one token "
                "(vLLM's scheduler cannot run an empty prompt)"
            )
        if set(map(type, seq)) <= {int}:  # the common case, checked at C speed (a call holds ~10^5 tokens)
            _check_range(i, seq, vocab)
            continue
        for j, token in enumerate(seq):
            if not _is_int(token):
                raise TypeError(
                    f"{WHERE}: sequence {i} holds {token!r:.60} ({type(token).__name__}) at position {j}; "
                    "token ids must be ints"
                )
        _check_range(i, seq, vocab)


def tuples_as_lists(token_ids: Any) -> Any:
    """The batch with tuple sequences (and a tuple batch) as lists; the very same object if there are none."""
    if not isinstance(token_ids, list | tuple):
        return token_ids
    if isinstance(token_ids, list) and not any(isinstance(seq, tuple) for seq in token_ids):
        return token_ids
    return [list(seq) if isinstance(seq, tuple) else seq for seq in token_ids]


def _check_range(i: int, seq: list[Any], vocab: int | None) -> None:
    low, high = min(seq), max(seq)
    if low < 0 or (vocab is not None and high >= vocab):
        bad = low if low < 0 else high
        shown = f"[0, {vocab})" if vocab is not None else "non-negative"
        raise ValueError(
            f"{WHERE}: sequence {i} holds token id {bad} at position {list(seq).index(bad)}, "
            f"outside the model's vocabulary {shown}"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _torch() -> Any:
    import sys

    return sys.modules.get("torch")  # speculators imported it already; never import it here


def abort_leftovers(generator: Any, call: int) -> None:
    """Abort the requests a failed ``generate()`` call left in the scheduler (ids ``req_{call}_{i}``)."""
    scheduler = getattr(generator, "scheduler", None)
    requests = getattr(scheduler, "requests", None)
    if not isinstance(requests, dict):
        return
    prefix = f"req_{call}_"
    left = [rid for rid in list(requests) if isinstance(rid, str) and rid.startswith(prefix)]
    if not left:
        return
    finish = scheduler.finish_requests
    finish = getattr(finish, "__wrapped__", finish)  # past a deferring wrapper (defer-abort-until-prefilled)
    try:
        from vllm.v1.request import RequestStatus

        finish(left, RequestStatus.FINISHED_ABORTED)
        logger.info("vllm-compat: aborted %d request(s) left by a failed generate() call", len(left))
    except Exception:  # the scheduler is beyond repair (e.g. the engine died): the original error says why
        logger.warning("vllm-compat: could not abort the requests of a failed generate() call", exc_info=True)
