"""What speculators' client asks of `vllm serve`'s OpenAI server, as far as reading the code can tell: the request
extras it sends and the response fields it reads (the server's behaviour itself is for an end-to-end run)."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_compat.probes._kit import evidence, first_found
from vllm_compat.probes._native import CHAT, HSC, N06, N07, N08, N09, NATIVE_LINES

from vllm_compat.apiview import ApiView
from vllm_compat.findings import BASELINE, Observation, probe

_OPENAI = "vllm.entrypoints.openai"
_HOMES = (f"{_OPENAI}.completion.protocol", f"{_OPENAI}.chat_completion.protocol", f"{_OPENAI}.protocol")


def _fields(view: ApiView, cls: str, wanted: Sequence[str]) -> tuple[list[str], str] | Observation:
    """(the ``wanted`` fields ``cls`` lacks, evidence), or an observation saying why that cannot be told."""
    found = first_found(view, [f"{home}.{cls}" for home in _HOMES])
    if found is None:
        return Observation("missing", f"vLLM's OpenAI server has no {cls}")
    names = view.members(found[0])  # pydantic models: the annotated names of the class and its bases
    if names is None:
        return Observation.unknown(f"the fields of {cls} are not readable", evidence(found[1]))
    return [w for w in wanted if w not in names], evidence(found[1])


def _judge(view: ApiView, wants: Sequence[tuple[str, Sequence[str]]], ok: str) -> Observation:
    lacking, where = [], []
    for cls, fields in wants:
        got = _fields(view, cls, fields)
        if isinstance(got, Observation):
            return got
        lacking += [f"{cls}.{f}" for f in got[0]]
        where.append(got[1])
    if lacking:
        return Observation("lacks=" + ",".join(lacking), f"missing: {', '.join(lacking)}", tuple(where))
    return Observation(BASELINE, ok, tuple(where))


@probe(
    "native.server.completions",
    symbol=f"{_OPENAI}.completion.protocol.CompletionRequest",
    summary="/v1/completions takes return_token_ids and answers with kv_transfer_params and prompt_token_ids",
    expected=dict.fromkeys(
        NATIVE_LINES,
        "CompletionRequest.return_token_ids; CompletionResponse.kv_transfer_params; "
        "CompletionResponseChoice.prompt_token_ids",
    ),
)
def completions(view: ApiView) -> Observation:
    return _judge(
        view,
        (
            ("CompletionRequest", ("return_token_ids", "max_tokens", "prompt")),
            ("CompletionResponse", ("kv_transfer_params",)),
            ("CompletionResponseChoice", ("prompt_token_ids",)),
        ),
        "the completion request and response carry what the client sends and reads",
    )


_CHAT_REQUEST = {
    N06: ("return_token_ids", "add_generation_prompt", "max_tokens"),
    **dict.fromkeys((N07, N08, N09), ("return_token_ids", "add_generation_prompt", "continue_final_message",
                                       "max_tokens")),
}  # fmt: skip


@probe(
    "native.server.chat",
    symbol=f"{_OPENAI}.chat_completion.protocol.ChatCompletionRequest",
    summary="/v1/chat/completions takes the extras speculators sends and answers with kv_transfer_params and "
    "prompt_token_ids",
    expected={
        line: f"ChatCompletionRequest.{', '.join(fields)}; ChatCompletionResponse.kv_transfer_params, prompt_token_ids"
        for line, fields in _CHAT_REQUEST.items()
    },
)
def chat(view: ApiView) -> Observation:
    per_line = {}
    first = None
    for line in CHAT:
        obs = _judge(
            view,
            (
                ("ChatCompletionRequest", _CHAT_REQUEST[line]),
                ("ChatCompletionResponse", ("kv_transfer_params", "prompt_token_ids")),
            ),
            "the chat request and response carry what the client sends and reads",
        )
        first = first or obs
        per_line[line] = obs.variant
    return Observation(first.variant, first.observed, first.evidence, per_line=per_line)


@probe(
    "native.server.render",
    symbol=f"{_OPENAI}.chat_completion.api_router.render_chat_completion",
    summary="`vllm serve` offers /v1/chat/completions/render (speculators 0.8's preprocessing renders prompts there)",
    expected=dict.fromkeys(HSC, "a /v1/chat/completions/render route (render_chat_completion)"),
)
def render(view: ApiView) -> Observation:
    found = first_found(
        view,
        [
            f"{home}.api_router.render_chat_completion"
            for home in (
                "vllm.entrypoints.scale_out.render",
                "vllm.entrypoints.serve.render",
                f"{_OPENAI}.chat_completion",
            )
        ],
    )
    if found is None:
        return Observation("missing", "no render_chat_completion route: /v1/chat/completions/render is not served")
    return Observation(BASELINE, f"{found[0]} serves /v1/chat/completions/render", (evidence(found[1]),))
