"""The states check: how far each bf16 path is from a float32 forward, per layer, and vLLM's paths against each other.

bf16 drift grows with depth, so a fixed bound against transformers' bf16 forward (``3e-2 * max|ref| + 1e-3`` per
tensor: it fits a 4-layer model) says little about a 32-layer one. Instead both bf16 paths, vLLM's and
transformers', are measured against transformers' float32 forward of the same weights (the references, computed by
the build side), per checked layer over the checked sequences:

- ``max_rel = max|x - fp32| / max|fp32|`` and ``mean_rel = sum|x - fp32| / sum|fp32|``.
- A vLLM side passes where, at every layer, both are at most ``factor`` times transformers' bf16 ones (or below
  one bf16 rounding: ``max_rel <= 2^-8``, ``mean_rel <= 2^-10``, which no path can be told apart under).

The fixed bound against transformers' bf16 is still reported (``old_bound_worst``: its worst tensor, in units of
the bound). vLLM's sides are also compared with each other exactly (the same kernels): bit-identical is expected
where they ran the same batches; where not, the report says whether their batches differed.
"""

from __future__ import annotations

from pathlib import Path

from .config import split_name

MAX_FLOOR, MEAN_FLOOR = 2.0**-8, 2.0**-10
OLD_REL, OLD_ABS = 3e-2, 1e-3


def errors(got: list, want: list) -> dict:
    """max_rel, mean_rel and max|diff| of ``got`` against ``want`` (lists of tensors: one per sequence)."""
    max_abs = max_ref = sum_abs = sum_ref = 0.0
    for g, w in zip(got, want, strict=True):
        w = w.float()
        diff = (g.float() - w).abs()
        max_abs = max(max_abs, diff.max().item())
        max_ref = max(max_ref, w.abs().max().item())
        sum_abs += diff.double().sum().item()
        sum_ref += w.abs().double().sum().item()
    return {
        "max_rel": max_abs / max_ref if max_ref else float("inf"),
        "mean_rel": sum_abs / sum_ref if sum_ref else float("inf"),
        "max_abs": max_abs,
    }


def old_bound_worst(got: list, want: list) -> float:
    """The worst tensor against transformers' bf16, in units of ``3e-2 * max|ref| + 1e-3`` (the earlier check)."""
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        w = w.float()
        worst = max(worst, (g.float() - w).abs().max().item() / (OLD_REL * w.abs().max().item() + OLD_ABS))
    return worst


def predict_steps(lengths: list[int], budget: int, max_seqs: int, chunked: bool) -> list[list[int]]:
    """The steps ``[sequences, tokens]`` a first-come-first-served prefill of ``lengths`` takes."""
    steps, left, i = [], list(lengths), 0
    while i < len(left):
        seqs = tokens = 0
        j = i
        while j < len(left) and seqs < max_seqs and tokens < budget:
            take = min(left[j], budget - tokens)
            if take < left[j] and not chunked:
                break
            tokens += take
            seqs += 1
            left[j] -= take
            if left[j]:
                break
            j += 1
        if not seqs:
            break  # a prompt longer than the budget without chunking: vLLM refuses it
        steps.append([seqs, tokens])
        i = j
    return steps


def batching_of(result: dict, lengths: list[int]) -> dict:
    """How a vLLM side batched the checked call: what it recorded, else what its settings give."""
    if result.get("check_steps"):
        return {"steps": result["check_steps"], "how": "recorded"}
    settings = result.get("settings") or {}
    chunked = settings.get("enable_chunked_prefill", True)
    budget, max_seqs = settings.get("max_num_batched_tokens"), settings.get("max_num_seqs")
    if not budget or not max_seqs:
        return {"steps": None, "how": "unknown"}
    steps = predict_steps(lengths, budget, max_seqs, chunked)
    return {"steps": steps, "how": f"from its settings (chunked prefill {'on' if chunked else 'off'})"}


def run_check(reference_path: str, samples: dict[str, Path], sides: dict[str, dict], factor: float, lengths) -> dict:
    """The report: per side and layer the errors against float32, pass or not, and the exact comparisons."""
    import torch

    ref = torch.load(reference_path, weights_only=False)
    info, layers = ref["info"], ref["info"]["layers"]
    bf16_name = next(p for p in ref["states"] if p != "float32")
    fp32, hf = ref["states"]["float32"], ref["states"][bf16_name]
    report: dict = {
        "reference": info,
        "factor": factor,
        "criterion": (
            f"per layer, vLLM's max_rel and mean_rel against float32 at most {factor} x transformers' {bf16_name} "
            f"ones (or below max_rel {MAX_FLOOR:.4f} / mean_rel {MEAN_FLOOR:.5f}, one bf16 rounding)"
        ),
        "layers": layers,
        "positions": info["positions"],
        "sides": {},
        "exact": {},
    }

    def by_layer(states: list[list]) -> dict[int, list]:
        return {layer: [seq[k] for seq in states] for k, layer in enumerate(layers)}

    want, hf_layers = by_layer(fp32), by_layer(hf)
    report["sides"][f"transformers {bf16_name}"] = {
        "per_layer": [{"layer": layer, **errors(hf_layers[layer], want[layer])} for layer in layers],
    }
    hf_rows = {row["layer"]: row for row in report["sides"][f"transformers {bf16_name}"]["per_layer"]}
    loaded: dict[str, dict[int, list]] = {}
    for name, path in samples.items():
        sample = torch.load(path, weights_only=False)
        if sample["ids"] != ref["ids"] or sample["positions"] != info["positions"]:
            report["sides"][name] = {"error": "its checked sequences are not the references' (other prompts)"}
            continue
        got = {layer: [seq[k] for seq in sample["states"]] for k, layer in enumerate(sample["layers"])}
        missing = sorted(set(layers) - set(got))
        if missing:
            report["sides"][name] = {"error": f"no states for layers {missing}"}
            continue
        loaded[name] = got
        rows = []
        for layer in layers:
            row = {"layer": layer, **errors(got[layer], want[layer])}
            base = hf_rows[layer]
            row["max_vs_hf"] = row["max_rel"] / base["max_rel"] if base["max_rel"] else float("inf")
            row["mean_vs_hf"] = row["mean_rel"] / base["mean_rel"] if base["mean_rel"] else float("inf")
            row["passed"] = (row["max_rel"] <= factor * base["max_rel"] or row["max_rel"] <= MAX_FLOOR) and (
                row["mean_rel"] <= factor * base["mean_rel"] or row["mean_rel"] <= MEAN_FLOOR
            )
            rows.append(row)
        report["sides"][name] = {
            "per_layer": rows,
            "passed": all(row["passed"] for row in rows),
            "old_bound_worst": max(old_bound_worst(got[layer], hf_layers[layer]) for layer in layers),
        }
    report.update(exact_comparisons(loaded, layers, sides, lengths))
    checked = [s for n, s in report["sides"].items() if not n.startswith("transformers")]
    report["passed"] = bool(checked) and all(s.get("passed") for s in checked)
    return report


def exact_comparisons(loaded: dict[str, dict[int, list]], layers: list[int], sides: dict, lengths) -> dict:
    """Every vLLM side's states against the first extraction side's, element for element."""
    bases = [n for n in loaded if split_name(n)[0] == "extract"]
    if not bases:
        return {"exact": {}}
    base = bases[0]
    exact = {}
    base_steps = batching_of(sides.get(base, {}), lengths)
    for name, got in loaded.items():
        if name == base:
            continue
        rows = []
        for layer in layers:
            a, b = loaded[base][layer], got[layer]
            differing = sum(int((x != y).sum().item()) for x, y in zip(a, b, strict=True))
            total = sum(x.numel() for x in a)
            worst = max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True))
            rows.append({"layer": layer, "max_abs": worst, "differing_fraction": differing / total})
        identical = all(row["differing_fraction"] == 0 for row in rows)
        steps = batching_of(sides.get(name, {}), lengths)
        same_batches = base_steps["steps"] is not None and base_steps["steps"] == steps["steps"]
        if identical:
            why = None
        elif same_batches:
            why = "the same batches, yet other bits: the two paths compute or capture the states differently"
        elif steps["steps"] is None or base_steps["steps"] is None:
            why = "batches unknown for one side"
        else:
            why = "other batches (bf16 GEMMs of other shapes round differently)"
        exact[f"{name} vs {base}"] = {
            "identical": identical,
            "per_layer": rows,
            "batches": {base: base_steps, name: steps},
            "same_batches": same_batches,
            "why": why,
        }
    return {"exact": exact}
