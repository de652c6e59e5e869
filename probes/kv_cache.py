"""vllm.v1.core.kv_cache_utils: the KV-cache planning helpers speculators calls before the Scheduler."""

from __future__ import annotations

import ast

from vllm_compat.probes._kit import LINES, V030, V040, call_probe, calls, evidence, first_found, parse_source

from vllm_compat.apiview import ApiView
from vllm_compat.findings import BASELINE, Observation, probe

_HOMES = ("vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_planning")


def _homes(name: str) -> list[str]:
    return [f"{module}.{name}" for module in _HOMES]


call_probe(
    "kv_cache.config_from_groups_kwargs",
    _homes("get_kv_cache_config_from_groups"),
    {
        V030: ["vllm_config", "kv_cache_groups", "kv_cache_specs", "available_memory"],
        V040: ["vllm_config", "kv_cache_groups", "available_memory"],
    },
    "get_kv_cache_config_from_groups(vllm_config=, kv_cache_groups=, [kv_cache_specs=,] available_memory=)",
)
call_probe(
    "kv_cache.uniform_spec_groups_call",
    _homes("_get_kv_cache_groups_uniform_spec"),
    {key: [] for key in LINES},
    "_get_kv_cache_groups_uniform_spec(kv_cache_spec) positionally",
    positional_by_line=dict.fromkeys(LINES, 1),
)
call_probe(
    "kv_cache.unify_hybrid_specs_call",
    _homes("unify_hybrid_kv_cache_specs"),
    {key: [] for key in LINES},
    "unify_hybrid_kv_cache_specs(kv_cache_spec) positionally",
    positional_by_line=dict.fromkeys(LINES, 1),
)


@probe(
    "kv_cache.layout_precondition",
    symbol="vllm.v1.core.kv_cache_utils.get_kv_cache_config_from_groups",
    summary="planning the KV cache needs nothing set up beforehand",
    expected=dict.fromkeys(LINES, "get_kv_cache_config_from_groups works on a fresh VllmConfig"),
)
def layout_precondition(view: ApiView) -> Observation:
    found = first_found(view, _homes("get_kv_cache_config_from_groups"))
    if found is None:
        return Observation.unknown("get_kv_cache_config_from_groups not found")
    parsed = parse_source(view, found[0])
    if parsed is None:
        return Observation.unknown("its source is not readable", evidence(found[1]))
    if "get_resolved_kv_cache_layout" in calls(parsed[0]):
        return Observation(
            "layout_required",
            "it reads cache_config.get_resolved_kv_cache_layout(): the KV-cache layout must be resolved and "
            "set on the workers first (as EngineCore does), or it raises ValueError",
            (evidence(found[1]),),
        )
    return Observation(BASELINE, "no precondition found in its body", (evidence(found[1]),))


_EXTENSIBLE = "enable_extensible_kv_cache"
_RESOLVER = "vllm.config.VllmConfig._resolve_extensible_kv_cache"


@probe(
    "kv_cache.commitment",
    symbol=f"vllm.config.CacheConfig.{_EXTENSIBLE}",
    summary="the KV cache the plan sizes is committed whole when the workers initialise it",
    expected=dict.fromkeys(
        LINES, "initialize_from_config() commits the whole KV cache; nothing extends it after the warm-up"
    ),
    accepts={key: {BASELINE, "opt_in"} for key in LINES},
)
def kv_cache_commitment(view: ApiView) -> Observation:
    """Variants: ``baseline`` (no extensible KV cache), ``opt_in`` (it exists, off unless asked), ``on_by_default``
    (VllmConfig turns it on where the platform supports it, and honours an explicit False), ``forced`` (the resolver
    sets it without looking at what was asked: an explicit False would not hold).

    With the extensible cache the workers commit only the KV memory the warm-up touched; EngineCore then calls
    ``finalize_extensible_kv_cache()`` and ``executor.extend_kv_cache(num_blocks)``. speculators' generator skips
    EngineCore, so its first call larger than the warm-up writes past the committed pages (an illegal memory
    access on CUDA, seen with vLLM 0.34.0 on an H200)."""
    params = view.parameters("vllm.config.CacheConfig")
    if params is None:
        return Observation.unknown("CacheConfig has no readable fields")
    where = evidence(view.locate("vllm.config.CacheConfig"))
    field_ = next((p for p in params if p.name == _EXTENSIBLE), None)
    if field_ is None:
        return Observation(BASELINE, f"CacheConfig has no {_EXTENSIBLE}: the KV cache is allocated whole", (where,))
    default = (field_.default or "").replace(" ", "")
    if default in {"False", "Field(default=False)"}:
        return Observation("opt_in", f"{_EXTENSIBLE} defaults to False: off unless asked", (where,))
    parsed = parse_source(view, _RESOLVER)
    if parsed is None:
        return Observation.unknown(
            f"{_EXTENSIBLE} defaults to {field_.default}, and {_RESOLVER} is not readable", where
        )
    tree, loc = parsed
    settings = _assignments(tree, _EXTENSIBLE)
    if not settings:
        return Observation.unknown(f"{_RESOLVER} does not set {_EXTENSIBLE}", evidence(loc))
    if not all(_guarded_by_none_check(tree, node) for node in settings):
        return Observation(
            "forced",
            f"{_RESOLVER} sets {_EXTENSIBLE} whatever was asked: an explicit False does not keep the KV cache whole",
            (where, evidence(loc)),
        )
    return Observation(
        "on_by_default",
        f"{_EXTENSIBLE} defaults to {field_.default} and VllmConfig turns it on where the platform supports it "
        "(CUDA, ROCm): workers commit only the KV memory the warm-up touches, and only EngineCore extends it",
        (where, evidence(loc, f"sets {_EXTENSIBLE} when it was left unset")),
    )


def _assignments(tree: ast.AST, attr: str) -> list[ast.AST]:
    """The statements of ``tree`` that assign ``<something>.attr``."""
    found: list[ast.AST] = []
    for node in ast.walk(tree):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign | ast.AugAssign)
            else []
        )
        if any(isinstance(t, ast.Attribute) and t.attr == attr for t in targets):
            found.append(node)
    return found


def _guarded_by_none_check(tree: ast.AST, target: ast.AST) -> bool:
    """Whether ``target`` runs only inside an ``if``-branch whose test asks ``... is None``."""

    def walk(node: ast.AST, guarded: bool) -> bool | None:
        if node is target:
            return guarded
        if isinstance(node, ast.If):
            asks_none = any(
                isinstance(n, ast.Compare)
                and any(isinstance(op, ast.Is) for op in n.ops)
                and any(isinstance(c, ast.Constant) and c.value is None for c in n.comparators)
                for n in ast.walk(node.test)
            )
            for child in node.body:
                seen = walk(child, guarded or asks_none)
                if seen is not None:
                    return seen
            for child in node.orelse:
                seen = walk(child, guarded)
                if seen is not None:
                    return seen
            return None
        for child in ast.iter_child_nodes(node):
            seen = walk(child, guarded)
            if seen is not None:
                return seen
        return None

    return bool(walk(tree, False))
