"""speculators' native line end to end: its own offline data generation, unchanged, against a real `vllm serve`.

speculators 0.5 to 0.9 extract hidden states through vLLM itself. A user starts `vllm serve` with the
``extract_hidden_states`` speculative method and a hidden-states KV connector (launch_vllm.py; tests/e2e/native.py
builds its command from the installed hs-connectors backend), renders the conversations through the server
(``speculators prepare-data --render-endpoint``, 0.8 and later), then ``speculators generate-offline-data`` sends each
sample to ``/v1/completions`` with ``max_tokens=1`` and moves the file named in ``kv_transfer_params`` into the
output folder. Both commands run here as installed, on a tiny local Llama with a chat template, the server on the
loopback interface with vLLM's defaults (bf16 on the CPU platform). Every saved file is then judged against
transformers' float32 forward of the same token ids (tests/e2e/native.py, ``judge``). The server runs under
``vllm-compat run``, as a user runs ``vllm-compat run -- python scripts/launch_vllm.py ...``: on vLLM's CPU platform
``native-connector-on-cpu`` makes the connector's copy off its cache synchronous (it needs CUDA streams, events and
pinned memory from vLLM 0.22.0), and nothing else of vllm-compat applies there; the clients run without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import native
from tests.e2e.report import record_all

pytestmark = pytest.mark.e2e
CHAT_TEMPLATE = "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
CONVERSATIONS = 24
SEQ_LENGTH = 2048  # prepare-data's --seq-length (its default, 8192, is above the tiny model's 4096 positions)


def _native_release() -> str:
    """The installed speculators, where it is a native-line release with its hs-connectors; else skip."""
    from vllm_compat.versions import installed_version, native_line

    version = installed_version("speculators")
    if native_line(version) is None:
        pytest.skip(f"speculators {version} is not a native-line release (0.5 to 0.9)")
    if importlib.util.find_spec("hs_connectors") is None:
        pytest.skip("hs-connectors is not installed (speculators 0.8 and later require it)")
    return str(version)


def _conversations(path: Path, count: int) -> Path:
    """ShareGPT-style JSONL (what prepare-data reads) in the tiny vocabulary's words; a few long replies."""
    rng = random.Random(5)

    def text(n: int) -> str:
        return " ".join(f"w{rng.randrange(0, 500)}" for _ in range(n))

    lengths = [rng.randrange(4, 120) for _ in range(count - 3)] + [700, 1100, 1500]
    rows = [
        {"conversations": [{"from": "human", "value": text(rng.randrange(3, 30))}, {"from": "gpt", "value": text(n)}]}
        for n in lengths
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(cmd: list[str], env: dict[str, str], cwd: Path, log_file: Path, timeout: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    with log_file.open("w") as out:
        try:
            rc = subprocess.run(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    tail = log_file.read_text(errors="replace")[-3000:]
    return {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), "tail": tail}


@pytest.fixture(scope="module")
def native_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Start `vllm serve`, run prepare-data and generate-offline-data against it, stop it; what each step did."""
    release = _native_release()
    from transformers import AutoTokenizer

    from tests.e2e.tiny_model import build_tiny_llama

    work = tmp_path_factory.mktemp("native")
    model = build_tiny_llama(work / "model", num_layers=4)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model)
    # launch_vllm.py --target-layer-ids 1 2 3: its default repeats layer 2 on a 4-layer model (native.launch_layer_ids)
    layer_ids = native.launch_layer_ids(4, [1, 2, 3])
    staging, prepared, out = work / "staging", work / "prepared", work / "hidden_states"
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(work / "hf-datasets"),
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    # the test session's VLLM_COMPAT_DISABLE (tests/conftest.py) would keep vllm-compat out of the server
    for name in ("VLLM_COMPAT_AUTO", "VLLM_COMPAT_E2E_REPORT", "VLLM_COMPAT_DISABLE"):
        env.pop(name, None)
    port = native.free_port()
    kv_config = native.kv_transfer_config("file", staging)
    # the user's vLLM arguments (launch_vllm.py passes what follows `--`): the loopback interface, and the flags this
    # vLLM's own errors ask for before the flow can run (native.needed_serve_flags; on record, and in the docs)
    flags = native.needed_serve_flags()
    vllm_args = ["--host", "127.0.0.1", "--port", str(port), *flags]
    # `vllm-compat run --`: vllm-compat is installed at start-up in every Python process of the server (the API
    # server, and the engine core that makes the worker's connector)
    wrapped = [str(Path(sys.executable).parent / "vllm-compat"), "run", "--"]
    server = native.Server(
        [*wrapped, *native.serve_command(model, layer_ids, kv_config, vllm_args)], port, work / "serve.log", env, work
    )
    run: dict[str, Any] = {"speculators": release, "layer_ids": layer_ids, "kv_transfer_config": kv_config}
    speculators = str(Path(sys.executable).parent / "speculators")
    try:
        server.start()
        run["server_ready_seconds"] = server.ready_s
        run["prepare"] = _run(
            [speculators, "prepare-data", "--model", str(model),
             "--data", str(_conversations(work / "conversations.jsonl", CONVERSATIONS)),
             "--render-endpoint", server.base, "--output", str(prepared), "--seq-length", str(SEQ_LENGTH)],
            env, work, work / "prepare.log", 900,
        )  # fmt: skip
        if run["prepare"]["rc"] == 0:
            run["generate"] = _run(
                [speculators, "generate-offline-data", "--endpoint", f"{server.base}/v1",
                 "--preprocessed-data", str(prepared), "--output", str(out), "--validate-outputs"],
                env, work, work / "generate.log", 900,
            )  # fmt: skip
    except RuntimeError as exc:  # the server did not come up: its errors are the record's excerpt
        run["serve_errors"] = server.errors()
        record_all({"native_serve_errors": run["serve_errors"]})
        raise RuntimeError(f"{exc}\nvllm serve's errors: {run['serve_errors']}") from None
    finally:
        server.stop()
        run["serve_tail"] = server.tail(3000)
    run["serve_errors"] = server.errors()
    run["adapted"] = native.adapted(server.log_file.read_text(errors="replace"))
    run.update(work=work, model=model, prepared=prepared, out=out)
    record_all({
        "native_speculators": release, "native_vllm_args": list(flags),
        "native_server_ready_seconds": run.get("server_ready_seconds"),
        "native_prepare_seconds": run.get("prepare", {}).get("seconds"),
        "native_generate_seconds": run.get("generate", {}).get("seconds"), "native_serve_errors": run["serve_errors"],
        "native_adapted": run["adapted"],
    })  # fmt: skip
    return run


def _saved(run: dict[str, Any]) -> tuple[list[list[int]], dict[int, Path]]:
    from datasets import load_from_disk

    dataset = load_from_disk(str(run["prepared"]))
    files = {int(p.stem.split("_")[1]): p for p in run["out"].glob("hs_*.safetensors")}
    return [list(map(int, row["input_ids"])) for row in dataset], files


def test_offline_data_generation_saves_every_sample(native_run: dict[str, Any]) -> None:
    """prepare-data renders every conversation through the server; generate-offline-data saves one file per row."""
    prepare = native_run["prepare"]
    assert prepare["rc"] == 0, f"speculators prepare-data exited {prepare['rc']}:\n{prepare['tail']}"
    generate = native_run["generate"]
    assert generate["rc"] == 0, f"speculators generate-offline-data exited {generate['rc']}:\n{generate['tail']}"
    rows, files = _saved(native_run)
    record_all({"native_samples": len(files), "native_rows": len(rows)})
    assert len(rows) == CONVERSATIONS, f"prepare-data kept {len(rows)} of {CONVERSATIONS} conversations"
    missing = sorted(set(range(len(rows))) - set(files))
    assert not missing, (
        f"no hidden-state file for {len(missing)} of {len(rows)} rows ({missing[:10]}); vllm serve's errors: "
        f"{native_run['serve_errors']}\ngenerate-offline-data's output ends:\n{generate['tail'][-1500:]}"
    )
    assert max(len(r) for r in rows) > 1000, "the long conversations did not come through"


def test_the_connector_is_adapted_where_it_needs_cuda(native_run: dict[str, Any]) -> None:
    """Where the installed connector's copy needs CUDA-only calls (vLLM 0.22.0 on), ``native-connector-on-cpu`` was
    applied in the server's process that made the worker's connector (its own log line says so, with the pid); where
    it needs none, nothing was patched."""
    import ast

    from vllm_compat.probes.native_connector import cuda_only_uses

    source = native._vllm_source("distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py")
    known, other = cuda_only_uses(ast.parse(source))
    assert not other, other
    adapted = native_run["adapted"]
    if not known:
        assert adapted == [], f"nothing to adapt in this vLLM's connector, yet: {adapted}"
        pytest.skip("this vLLM's connector copies its states with nothing CUDA-only: nothing to adapt")
    errors = native_run["serve_errors"]
    assert adapted, f"native-connector-on-cpu was not applied in any server process; vllm serve's errors: {errors}"


def test_saved_states_match_transformers(native_run: dict[str, Any]) -> None:
    """Per layer slot, over every sample: vLLM's bf16 error against transformers' float32 forward stays within 1.5
    times transformers' own bf16 error (+1e-3), and no other layer's states come that close (a mislabelled or
    shifted layer fails)."""
    from safetensors.torch import load_file

    if native_run.get("generate", {}).get("rc") != 0:
        pytest.fail("no files to judge: generate-offline-data did not finish (see the test before)")
    rows, files = _saved(native_run)
    samples = [(rows[i], load_file(str(files[i]))) for i in sorted(files)]
    verdict = native.judge(native_run["model"], samples, native_run["layer_ids"])
    record_all({"native_judgement": verdict})
    table = "\n".join(
        f"  layer id {x['layer_id']}: vLLM {x['vllm']:.4f}, transformers bf16 {x['hf_bf16']:.4f}, bound "
        f"{x['bound']:.4f}, nearest other layer {x['nearest_other']}"
        for x in verdict["layers"]
    )
    assert not verdict["problems"], "\n".join(verdict["problems"])
    assert verdict["passed"], f"saved states against transformers (worst over {len(samples)} samples):\n{table}"


def test_the_judgement_fails_a_mislabelled_or_shifted_layer(tmp_path: Path) -> None:
    """The judgement itself, on transformers' own bf16 states of the tiny model (no server): right labels pass;
    two slots swapped, or every id read as the layer before it (vLLM before 0.18 collected a layer's input under its
    id: native.config.layer_index's ``before_layer``), fail. A judgement that cannot fail proves nothing."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.e2e.tiny_model import build_tiny_llama

    model_path = build_tiny_llama(tmp_path / "model", num_layers=4)
    bf16 = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
    rng = random.Random(3)
    layer_ids = native.launch_layer_ids(4, [1, 2, 3])

    def samples(read_as: list[int]) -> list[tuple[list[int], dict]]:
        out = []
        for n in (5, 40, 300):
            ids = [rng.randrange(4, 512) for _ in range(n)]
            states = native.transformers_states(bf16, ids, 4)
            saved = torch.stack([states[k].to(torch.bfloat16) for k in read_as], dim=1)
            out.append((ids, {"hidden_states": saved, "token_ids": torch.tensor(ids)}))
        return out

    right = native.judge(model_path, samples(layer_ids), layer_ids)
    assert right["passed"], right["layers"]
    swapped = native.judge(model_path, samples([1, 3, 2, 4]), layer_ids)
    assert not swapped["passed"] and [x["passed"] for x in swapped["layers"]] == [True, False, False, True]
    shifted = native.judge(model_path, samples([k - 1 for k in layer_ids]), layer_ids)
    assert not shifted["passed"] and not any(x["passed"] for x in shifted["layers"])
