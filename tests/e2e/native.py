"""speculators' native line (0.5 to 0.9) as a user runs it: `vllm serve` started the way its launch_vllm.py starts
it, and every hidden-state file it saves judged against transformers.

The launch command is the one speculators' ``scripts/launch_vllm.py`` builds (the script is not in speculators'
wheel or sdist; its contract is read from the release's repository): ``python -m vllm.entrypoints.cli.main serve
MODEL --speculative_config '{"method": "extract_hidden_states", "num_speculative_tokens": 1, "draft_model_config":
{"hf_config": {"eagle_aux_hidden_state_layer_ids": IDS}}}' --kv_transfer_config JSON *VLLM_ARGS``, where IDS default
to ``[2, n // 2, n - 3, n]`` for a model of n layers (n: the last layer's output) and JSON comes from the
hidden-states backend's own ``build_kv_transfer_config`` (hs-connectors' ``HiddenStatesBackend.registry``, which the
script asks for its backends and their launch arguments). Nothing of speculators or hs-connectors is copied here:
their installed code is called.

The judgement (:func:`judge`): per layer slot of the saved files, vLLM's worst relative error against transformers'
float32 forward of the same token ids, over every sample, must stay within ``factor`` times transformers' own bf16
error on the same samples (plus 1e-3), and every other layer's float32 states must miss that bound, so that a
mislabelled or shifted layer fails.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("vllm_compat")

FACTOR = 1.5  # vLLM's bf16 error may be this much above transformers' own bf16 error (tests/gpu/user_scripts.py)
SLACK = 1e-3  # plus this, relative: where transformers' bf16 error is itself near zero (the embeddings)


def launch_layer_ids(num_layers: int, target: list[int] | None = None) -> list[int]:
    """The layer ids launch_vllm.py puts in the speculative config: ``--target-layer-ids`` with ``num_layers`` (the
    last layer's output) appended where missing, else its default ``[2, n // 2, n - 3, n]``.

    That default repeats a layer on models of 6 layers or fewer (``[2, 2, 1, 4]`` on 4), and a repeated id stops
    vLLM's engine at the first request (vLLM 0.32.0: the extract_hidden_states proposer stacks one state per distinct
    layer into a buffer sized for every id, ``RuntimeError: The expanded size of the tensor (4) must match the
    existing size (3)``, then ``EngineDeadError`` for every request after it). Models that size are test models only,
    so the test names distinct ids, as a user of such a model must."""
    if not target:
        return [2, num_layers // 2, num_layers - 3, num_layers]
    return [*target, *([num_layers] if num_layers not in target else [])]


def kv_transfer_config(backend: str, hidden_states_path: Path) -> dict[str, Any]:
    """The ``--kv_transfer_config`` launch_vllm.py passes for ``--hidden-states-backend BACKEND``, from the backend's
    own code (hs-connectors 0.8 and later register them in ``HiddenStatesBackend.registry``)."""
    from hs_connectors import HiddenStatesBackend

    backend_cls = HiddenStatesBackend.registry[backend]
    parser = argparse.ArgumentParser()
    backend_cls.add_launch_args(parser)
    args, _ = parser.parse_known_args(["--hidden-states-path", str(hidden_states_path)])
    return backend_cls.build_kv_transfer_config(args)


def serve_command(model: Path, layer_ids: list[int], kv_config: dict[str, Any], vllm_args: list[str]) -> list[str]:
    """launch_vllm.py's command line: the module entry point of ``vllm serve``, the two JSON configs, then the user's
    vLLM arguments."""
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
    }
    return [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
        "--speculative_config", json.dumps(speculative), "--kv_transfer_config", json.dumps(kv_config), *vllm_args,
    ]  # fmt: skip


def _vllm_source(relative: str) -> str:
    """The text of a module of the installed vLLM ("" where it has none), read without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return ""
    path = Path(spec.origin).parent / relative
    return path.read_text() if path.is_file() else ""


def needed_serve_flags() -> dict[str, str]:
    """The `vllm serve` flags the installed vLLM needs before speculators 0.9.0's flow can run, each with why; what
    a user adds after ``--`` to launch_vllm.py, told by vLLM's own error. Read from vLLM's source:

    - ``--enable-scale-out`` (vLLM 0.30.0 on): ``/v1/chat/completions/render``, where prepare-data renders every
      conversation, answers 403 ("Scale-out endpoints are disabled") without it;
    - ``--no-enable-chunked-prefill`` (vLLM 0.22.0 to 0.23.0): the config refuses ExampleHiddenStatesConnector with
      chunked prefill on, and launch_vllm.py no longer turns it off (speculators removed the flag in August 2026).
    """
    flags = {}
    if "enable_scale_out" in _vllm_source("entrypoints/scale_out/factories.py"):
        flags["--enable-scale-out"] = "the render route prepare-data uses is served only with it"
    if "ExampleHiddenStatesConnector does not support chunked prefill" in _vllm_source("config/vllm.py"):
        flags["--no-enable-chunked-prefill"] = "vLLM refuses ExampleHiddenStatesConnector with chunked prefill"
    return flags


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """One `vllm serve` process group on the loopback interface, its output in ``log_file``."""

    cmd: list[str]
    port: int
    log_file: Path
    env: dict[str, str]
    cwd: Path
    proc: subprocess.Popen | None = None
    started_s: float = 0.0
    ready_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 600.0) -> None:
        """Start the server and wait until /v1/models answers; raise with the log's tail if it dies or times out."""
        self.started_s = time.perf_counter()
        with self.log_file.open("w") as out:
            self.proc = subprocess.Popen(
                self.cmd, env=self.env, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {self.proc.returncode} before it answered:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.base}/v1/models", timeout=5) as reply:
                    if reply.status == 200:
                        self.ready_s = round(time.perf_counter() - self.started_s, 1)
                        log.info("vllm serve answered after %.0f s", self.ready_s)
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(2)
        self.stop()
        raise RuntimeError(f"vllm serve did not answer within {timeout:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        """SIGTERM to the process group (vLLM's engine core and workers too), SIGKILL after 30 s."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def tail(self, chars: int = 4000) -> str:
        return self.log_file.read_text(errors="replace")[-chars:] if self.log_file.exists() else ""

    def errors(self, limit: int = 8) -> list[str]:
        """The distinct error lines of the server's log, first seen first (vLLM's prefixes cut): the root cause of
        a failed request is there, not in the client's 500."""
        if not self.log_file.exists():
            return []
        seen: dict[str, None] = {}
        for line in self.log_file.read_text(errors="replace").splitlines():
            text = _LOG_PREFIX.sub("", line).strip()
            if _ERROR_LINE.search(text) and not any(noise in text for noise in _NOISE):
                seen.setdefault(text[:300])
        return list(seen)[:limit]


_ADAPTED = re.compile(
    r"vllm-compat: ExampleHiddenStatesConnector copies the states synchronously .*"
    r"\(native-connector-on-cpu; pid (\d+)\)"
)


def adapted(log_text: str) -> list[int]:
    """The pids of the server's processes where ``native-connector-on-cpu`` logged that it patched the connector."""
    return sorted({int(m.group(1)) for m in _ADAPTED.finditer(log_text)})


_LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\) )?(ERROR|WARNING|INFO) \d\d-\d\d [\d:]+ \[[^\]]*\] ")
_ERROR_LINE = re.compile(r"^\w*(Error|Exception)\b.*:|^[\w.]+\.\w*(Error|Exception):|ValueError|Value error")
_NOISE = ("Attempted to load weight", "ulimit", "Traceback")


def transformers_states(model, ids: list[int], num_layers: int) -> list:
    """The residual stream under every layer id of the native line, float32: id 0 the embeddings, id k the output of
    decoder layer k - 1 (hooks, so that id num_layers is taken before the final norm, as vLLM saves it)."""
    import torch

    seen: dict[int, torch.Tensor] = {}

    def keep(k: int):
        return lambda _m, _a, out: seen.__setitem__(k, (out[0] if isinstance(out, tuple) else out)[0].float())

    hooks = [model.model.embed_tokens.register_forward_hook(keep(0))]
    hooks += [model.model.layers[i].register_forward_hook(keep(i + 1)) for i in range(num_layers)]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return [seen[k] for k in range(num_layers + 1)]


def _relative(got, want) -> float:
    return ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def judge(
    model_path: Path, samples: list[tuple[list[int], dict]], layer_ids: list[int], factor: float = FACTOR
) -> dict:
    """Judge every saved sample (its token ids, and the tensors of its file) against transformers.

    Per layer slot j (layer id ``layer_ids[j]``): ``vllm`` is the worst, over all samples, of max|saved - ref32| /
    max|ref32|; ``hf_bf16`` the same for transformers' bf16 forward; ``bound`` is ``factor * hf_bf16 + SLACK``;
    ``nearest_other`` the smallest relative distance of the saved states to the float32 states of any other layer id,
    over all samples. A slot passes when ``vllm <= bound < nearest_other``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    num_layers = AutoConfig.from_pretrained(model_path).num_hidden_layers
    models = {
        d: AutoModelForCausalLM.from_pretrained(model_path, dtype=d).eval() for d in (torch.float32, torch.bfloat16)
    }
    slots = len(layer_ids)
    worst_v, worst_t, nearest, worst_abs = [0.0] * slots, [0.0] * slots, [float("inf")] * slots, 0.0
    problems: list[str] = []
    for index, (ids, tensors) in enumerate(samples):
        saved_ids = tensors["token_ids"].tolist()
        if saved_ids != ids:
            problems.append(f"sample {index}: token_ids in the file differ from the sample's input_ids")
            continue
        states = tensors["hidden_states"]
        if tuple(states.shape[:2]) != (len(ids), slots):
            problems.append(f"sample {index}: hidden_states shape {tuple(states.shape)}, want ({len(ids)}, {slots}, H)")
            continue
        ref32 = transformers_states(models[torch.float32], ids, num_layers)
        ref16 = transformers_states(models[torch.bfloat16], ids, num_layers)
        for j, k in enumerate(layer_ids):
            got = states[:, j, :]
            worst_v[j] = max(worst_v[j], _relative(got, ref32[k]))
            worst_t[j] = max(worst_t[j], _relative(ref16[k], ref32[k]))
            worst_abs = max(worst_abs, (got.float() - ref32[k]).abs().max().item())
            others = [_relative(got, ref32[o]) for o in range(num_layers + 1) if o != k]
            nearest[j] = min(nearest[j], *others)
    layers = []
    for j, k in enumerate(layer_ids):
        bound = factor * worst_t[j] + SLACK
        layers.append({
            "slot": j, "layer_id": k, "vllm": round(worst_v[j], 6), "hf_bf16": round(worst_t[j], 6),
            "bound": round(bound, 6), "nearest_other": round(nearest[j], 6) if nearest[j] != float("inf") else None,
            "passed": bool(samples) and worst_v[j] <= bound < nearest[j],
        })  # fmt: skip
    return {
        "samples": len(samples), "layer_ids": layer_ids, "factor": factor, "layers": layers,
        "max_abs_diff": worst_abs, "problems": problems[:20],
        "passed": not problems and bool(samples) and all(layer["passed"] for layer in layers),
    }  # fmt: skip
