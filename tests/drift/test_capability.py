"""Judge by capability, not version.

Each test takes the real sources of vLLM 0.16.0 (extracted from its wheel, version metadata kept),
changes ONE thing the way a future vLLM might, and checks that exactly the findings about that thing
change (probe, speculators line, variant, evidence) while the version string stays "0.16.0". A
version-based compatibility table could not notice any of these; the probes must.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from vllm_compat.apiview.static import StaticView
from vllm_compat.findings import State
from vllm_compat.plan import Plan, make_plan

pytestmark = pytest.mark.wheels

RELEASE = "0.16.0"
V030, V040 = "0.3.0", "0.4.0.1"
LINES = (V030, V040)
Key = tuple[str, str]  # (probe id, speculators line)


@pytest.fixture
def tree(vllm_tree) -> Path:
    return vllm_tree(RELEASE)


@pytest.fixture(scope="module")
def base_plan(tmp_path_factory) -> Plan:
    """The findings for unchanged 0.16.0, read straight from its wheel."""
    from vllm_compat.errors import SourceError
    from vllm_compat.sources import fetch_release

    try:
        wheel = fetch_release(RELEASE)
    except SourceError as exc:
        pytest.skip(f"vllm=={RELEASE} is not cached and cannot be fetched: {exc}")
    return make_plan(StaticView(wheel), LINES)


def plan_of(tree: Path) -> Plan:
    return make_plan(StaticView(tree), LINES)


def edit(tree: Path, rel: str, old: str, new: str) -> None:
    """Replace the one occurrence of ``old`` in ``tree/rel`` (fails if the release's text differs)."""
    path = tree / rel
    text = path.read_text()
    assert text.count(old) == 1, f"{rel}: expected exactly one {old!r}"
    path.write_text(text.replace(old, new))


def cut_function(tree: Path, rel: str, name: str) -> str:
    """Remove the module-level ``def name`` from ``tree/rel`` and return its source text."""
    path = tree / rel
    text = path.read_text()
    node = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == name)
    lines = text.splitlines(keepends=True)
    start, end = (min(d.lineno for d in node.decorator_list) if node.decorator_list else node.lineno), node.end_lineno
    path.write_text("".join(lines[: start - 1] + lines[end:]))
    return "".join(lines[start - 1 : end])


def changes(before: Plan, after: Plan) -> dict[Key, tuple[str, str]]:
    """(probe, line) -> (variant before, variant after), for every finding whose variant changed."""
    old = {(f.probe, f.speculators): f.variant for f in before.findings}
    new = {(f.probe, f.speculators): f.variant for f in after.findings}
    assert old.keys() == new.keys()
    return {k: (old[k], new[k]) for k in old if old[k] != new[k]}


def finding(plan: Plan, probe: str, line: str):
    (found,) = [f for f in plan.findings if f.probe == probe and f.speculators == line]
    return found


def test_the_extracted_tree_judges_exactly_like_the_wheel(tree: Path, base_plan: Plan) -> None:
    plan = plan_of(tree)
    assert plan.vllm_version == RELEASE
    assert [f.to_json() for f in plan.findings] == [f.to_json() for f in base_plan.findings]


def test_a_new_version_string_alone_changes_nothing(tree: Path, base_plan: Plan) -> None:
    """Only the version changes: the findings do not (no probe looks at the version)."""
    (metadata,) = tree.glob("vllm-*.dist-info/METADATA")
    edit(tree, metadata.relative_to(tree).as_posix(), f"Version: {RELEASE}\n", "Version: 0.99.0\n")
    edit(tree, "vllm/_version.py", f"__version__ = version = '{RELEASE}'", "__version__ = version = '0.99.0'")
    plan = plan_of(tree)
    assert plan.vllm_version == "0.99.0"
    assert changes(base_plan, plan) == {}


def test_renamed_scheduler_config_field(tree: Path, base_plan: Plan) -> None:
    # vllm/config/scheduler.py:55 in 0.16.0
    edit(
        tree,
        "vllm/config/scheduler.py",
        "    max_num_seqs: int = Field(default=DEFAULT_MAX_NUM_SEQS, ge=1)",
        "    max_num_seqs_per_step: int = Field(default=DEFAULT_MAX_NUM_SEQS, ge=1)",
    )
    plan = plan_of(tree)
    assert plan.vllm_version == RELEASE
    assert changes(base_plan, plan) == {
        # 0.3.0 already lacked is_encoder_decoder on 0.16.0; now max_num_seqs is rejected too
        ("config.scheduler_config_kwargs", V030): (
            "requires=is_encoder_decoder",
            "rejects=max_num_seqs;requires=is_encoder_decoder",
        ),
        ("config.scheduler_config_kwargs", V040): ("baseline", "rejects=max_num_seqs"),
    }
    found = finding(plan, "config.scheduler_config_kwargs", V040)
    assert found.state is State.DRIFTED
    assert "vllm/config/scheduler.py:" in found.evidence
    assert "max_num_seqs_per_step" in found.observed


def test_new_required_request_parameter(tree: Path, base_plan: Plan) -> None:
    # vllm/v1/request.py:65 in 0.16.0
    edit(
        tree,
        "vllm/v1/request.py",
        "        eos_token_id: int | None,\n",
        "        eos_token_id: int | None,\n        totally_new_field: int,\n",
    )
    plan = plan_of(tree)
    assert plan.vllm_version == RELEASE
    assert changes(base_plan, plan) == {
        ("request.request_kwargs", V030): ("baseline", "requires=totally_new_field"),
        ("request.request_kwargs", V040): ("baseline", "requires=totally_new_field"),
    }
    found = finding(plan, "request.request_kwargs", V030)
    assert found.state is State.DRIFTED and not found.handled
    assert "vllm/v1/request.py:" in found.evidence


def test_planning_helper_moves_to_a_new_module(tree: Path, base_plan: Plan) -> None:
    """Like vLLM 0.33.0, but for one helper and in 0.16.0: the import breaks, the call shape does not."""
    moved = cut_function(tree, "vllm/v1/core/kv_cache_utils.py", "get_kv_cache_config_from_groups")
    (tree / "vllm/v1/core/kv_cache_planning.py").write_text('"""KV cache planning."""\n\n' + moved)
    plan = plan_of(tree)
    assert plan.vllm_version == RELEASE
    assert changes(base_plan, plan) == {
        ("import.v1.core.kv_cache_utils.get_kv_cache_config_from_groups", V030): ("baseline", "moved"),
        ("import.v1.core.kv_cache_utils.get_kv_cache_config_from_groups", V040): ("baseline", "moved"),
    }
    found = finding(plan, "import.v1.core.kv_cache_utils.get_kv_cache_config_from_groups", V040)
    assert "vllm/v1/core/kv_cache_planning.py:3" in found.evidence
    # the probes that call it now read it at its new home
    assert "kv_cache_planning.py" in finding(plan, "kv_cache.config_from_groups_kwargs", V040).evidence
    assert "kv_cache_planning.py" in finding(plan, "kv_cache.layout_precondition", V040).evidence
    # the helpers that stayed did not move
    assert finding(plan, "import.v1.core.kv_cache_utils.unify_hybrid_kv_cache_specs", V040).variant == "baseline"


def test_collective_rpc_returns_a_plain_list(tree: Path, base_plan: Plan) -> None:
    """The 0.11.0 shape in a 0.16.0 tree: the drift swaps from one speculators line to the other."""
    # vllm/v1/executor/multiproc_executor.py:363 in 0.16.0
    edit(
        tree,
        "vllm/v1/executor/multiproc_executor.py",
        "return responses[0] if output_rank is not None else responses",
        "return responses",
    )
    plan = plan_of(tree)
    assert plan.vllm_version == RELEASE
    assert changes(base_plan, plan) == {
        ("executor.unique_reply_shape", V030): ("single", "list"),
        ("executor.unique_reply_shape", V040): ("single", "list"),
    }
    assert finding(plan, "executor.unique_reply_shape", V030).state is State.BASELINE
    found = finding(plan, "executor.unique_reply_shape", V040)
    assert found.state is State.DRIFTED
    assert "vllm/v1/executor/multiproc_executor.py:303" in found.evidence  # def collective_rpc


def test_async_scheduling_default_off_again(tree: Path, base_plan: Plan) -> None:
    # vllm/config/scheduler.py:131 in 0.16.0
    edit(
        tree,
        "vllm/config/scheduler.py",
        "    async_scheduling: bool = Field(default=None)",
        "    async_scheduling: bool = False",
    )
    plan = plan_of(tree)
    assert changes(base_plan, plan) == {
        ("config.async_scheduling_default", V030): ("auto", "off"),
        ("config.async_scheduling_default", V040): ("auto", "off"),
    }
    assert {f.state for f in plan.findings if f.probe == "config.async_scheduling_default"} == {State.BASELINE}


def test_embedding_method_renamed_back(tree: Path, base_plan: Plan) -> None:
    # vllm/model_executor/models/llama.py:398 (LlamaModel; LlamaForCausalLM's own one at :579 stays)
    body = "(self, input_ids: torch.Tensor) -> torch.Tensor:\n        return self.embed_tokens("
    edit(
        tree,
        "vllm/model_executor/models/llama.py",
        f"    def embed_input_ids{body}",
        f"    def get_input_embeddings{body}",
    )
    plan = plan_of(tree)
    assert changes(base_plan, plan) == {
        ("model.embedding_method", V030): ("embed_input_ids", "get_input_embeddings"),
        ("model.embedding_method", V040): ("embed_input_ids", "get_input_embeddings"),
    }
    assert finding(plan, "model.embedding_method", V030).state is State.BASELINE
    assert finding(plan, "model.embedding_method", V040).state is State.DRIFTED
    assert "vllm/model_executor/models/llama.py:" in finding(plan, "model.embedding_method", V040).evidence


def test_scheduler_drops_block_size(tree: Path, base_plan: Plan) -> None:
    # vllm/v1/core/sched/scheduler.py:69 in 0.16.0
    edit(
        tree,
        "vllm/v1/core/sched/scheduler.py",
        "        structured_output_manager: StructuredOutputManager,\n        block_size: int,\n",
        "        structured_output_manager: StructuredOutputManager,\n",
    )
    plan = plan_of(tree)
    assert changes(base_plan, plan) == {
        ("scheduler.scheduler_kwargs", V030): ("requires=block_size", "baseline"),
        ("scheduler.scheduler_kwargs", V040): ("baseline", "rejects=block_size"),
    }
    assert "vllm/v1/core/sched/scheduler.py:" in finding(plan, "scheduler.scheduler_kwargs", V040).evidence


def test_planning_gains_the_layout_precondition(tree: Path, base_plan: Plan) -> None:
    """What vLLM 0.29.0 did (kv_cache_utils.py:1435 there), planted in 0.16.0's planner."""
    # vllm/v1/core/kv_cache_utils.py:1069-1073 in 0.16.0
    edit(
        tree,
        "vllm/v1/core/kv_cache_utils.py",
        "    available_memory: int,\n) -> KVCacheConfig:\n",
        "    available_memory: int,\n) -> KVCacheConfig:\n"
        "    layout = vllm_config.cache_config.get_resolved_kv_cache_layout()\n",
    )
    plan = plan_of(tree)
    assert changes(base_plan, plan) == {
        ("kv_cache.layout_precondition", V030): ("baseline", "layout_required"),
        ("kv_cache.layout_precondition", V040): ("baseline", "layout_required"),
    }
    found = finding(plan, "kv_cache.layout_precondition", V040)
    assert "vllm/v1/core/kv_cache_utils.py:1069" in found.evidence


def test_hashing_module_removed(tree: Path, base_plan: Plan) -> None:
    (tree / "vllm/utils/hashing.py").unlink()
    plan = plan_of(tree)
    assert changes(base_plan, plan) == {
        ("import.utils.hashing.get_hash_fn_by_name", V040): ("baseline", "missing"),
        ("request.hash_fn_by_name", V040): ("baseline", "missing"),
    }
