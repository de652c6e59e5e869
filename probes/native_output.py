"""The saved file's contract: what ExampleHiddenStatesConnector writes, and the path it hands the client."""

from __future__ import annotations

import ast

from vllm_compat.probes._kit import evidence, parse_source
from vllm_compat.probes._native import EXAMPLE, NATIVE_LINES

from vllm_compat.apiview import ApiView
from vllm_compat.findings import BASELINE, Observation, probe

KEYS = ("hidden_states", "token_ids")


@probe(
    "native.output.saved_file",
    symbol=EXAMPLE,
    summary="ExampleHiddenStatesConnector saves a safetensors file of hidden_states and token_ids, and returns its "
    "path as kv_transfer_params['hidden_states_path']",
    expected=dict.fromkeys(
        NATIVE_LINES,
        "safetensors save_file of {'hidden_states', 'token_ids'}; request_finished returns {'hidden_states_path': ...}",
    ),
)
def saved_file(view: ApiView) -> Observation:
    parsed = parse_source(view, EXAMPLE)
    if parsed is None:
        return Observation("missing", "vLLM has no ExampleHiddenStatesConnector")
    tree, loc = parsed
    constants = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    dict_keys = {
        k.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Dict)
        for k in n.keys
        if isinstance(k, ast.Constant) and isinstance(k.value, str)
    }
    saves = any(
        isinstance(n, ast.Call) and ast.unparse(n.func).rsplit(".", 1)[-1] == "save_file" for n in ast.walk(tree)
    )
    finished = parse_source(view, f"{EXAMPLE}.request_finished")
    path_key = finished is not None and "hidden_states_path" in {
        n.value for n in ast.walk(finished[0]) if isinstance(n, ast.Constant)
    }
    lacking = [k for k in KEYS if k not in dict_keys]
    if not saves:
        lacking.append("save_file")
    if not path_key:
        lacking.append("hidden_states_path")
    where = (evidence(loc), evidence(finished[1]) if finished else "")
    if lacking:
        return Observation(
            "changed=" + ",".join(lacking),
            f"the connector's file or reply no longer has: {', '.join(lacking)} (strings seen: "
            f"{', '.join(sorted(c for c in constants if c.isidentifier())[:8])})",
            tuple(w for w in where if w),
        )
    return Observation(
        BASELINE,
        "save_file({'hidden_states': ..., 'token_ids': ...}); request_finished returns hidden_states_path",
        tuple(w for w in where if w),
    )
