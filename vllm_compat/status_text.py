"""``vllm_compat.status()``: a plain mapping for programs (and JSON), a few readable lines for people.

``Status`` is a ``dict`` (every key callers and tests read stays as it was; ``json.dumps`` writes it as before); only
``str()`` changes: ``print(vllm_compat.status())`` says what was applied, why, in which processes, and what the flags
mean, instead of one long line. ``repr()`` stays the dict's, so debugging output and test diffs are unchanged.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Status", "describe"]

WIDTH = 116  # a reason longer than this is cut in str(); the mapping (and --json) keeps it whole


class Status(dict):
    """What vllm-compat did in this process: a dict (unchanged keys), readable as text with ``str()``."""

    def __str__(self) -> str:
        return describe(self)

    def __reduce__(self):
        """Pickled as a plain dict (torch.save, multiprocessing): loading it needs no vllm-compat, and
        ``torch.load(weights_only=True)`` accepts it as it did."""
        return (dict, (dict(self),))


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def _predicted_route() -> tuple[str, str] | None:
    """The route a generator built now would take to vLLM's workers (None where it cannot be told)."""
    try:
        from vllm_compat.adapters.plugin_fallback import workers_route

        return workers_route()
    except Exception:  # an odd environment must not stop a status print
        return None


def describe(status: dict[str, Any]) -> str:
    """The readable text of a status mapping (``vllm_compat.status()``, ``vllm-compat status``)."""
    pid = status.get("pid")
    applied: dict[str, str] = dict(status.get("applied") or {})
    pass_through: dict[str, list[str]] = dict(status.get("pass_through") or {})
    route, why = status.get("worker_route"), status.get("worker_route_why")
    in_worker = bool(status.get("in_worker"))
    if in_worker:
        role = f"a vLLM worker process (pid {pid}), reached through the {route} route"
    elif route is not None:
        role = f"the generator's process (pid {pid}): its vLLM workers are separate processes"
    else:
        role = f"this process (pid {pid}); no speculators generator has been built in it"
    out = [f"vllm-compat in {role}"]
    if not status.get("installed"):
        out.append("  installed: no: nothing is watched or applied here (import vllm_compat, `vllm-compat run --`, or")
        out.append("  VLLM_COMPAT_AUTO=1 activates it; VLLM_COMPAT_DISABLE=1 or uninstall() turned it off)")
    vllm, spec = status.get("vllm_version"), status.get("speculators_version")
    line, judged = status.get("speculators_line"), status.get("speculators_line_judged")
    line_text = f"line {line}" if line else "no line"
    out.append(
        f"  vLLM {vllm or 'not installed'}; speculators {spec or 'not installed'} ({line_text}, judged: {judged})"
    )

    if applied:
        out.append(f"  applied in this process ({len(applied)}), each with the finding it covers:")
        width = max(len(k) for k in applied)
        for adapter_id, reason in applied.items():
            out.append(_cut(f"    {adapter_id:<{width}}  {' '.join(str(reason).split())}", WIDTH))
    elif status.get("installed"):
        out.append(
            "  applied in this process: none yet (adapters apply when the vLLM and speculators modules they fix are "
            "imported)"
        )

    if str(line or "").startswith("native-") and not in_worker:
        out.append(
            f"  speculators {spec} extracts through `vllm serve` (the {line} line): vllm-compat reaches the server's "
            "processes only where it is started under `vllm-compat run --` (or VLLM_COMPAT_AUTO=1); `vllm-compat "
            "probe` is this line's guard"
        )
    elif in_worker:
        out.append(
            f"  vLLM's workers: this is one; vllm-compat was activated here by the {route} route ({why}); the adapters "
            "above are this worker's own"
        )
    elif route is not None:
        out.append(f"  vLLM's workers: reached through the {route} route: {why}.")
        out.append("    Each worker applies its own adapters; status() called in a worker lists them.")
    else:
        predicted = _predicted_route()
        if predicted is not None:
            out.append(
                f"  vLLM's workers: a generator built now would reach them through the {predicted[0]} route: "
                f"{predicted[1]}"
            )
    if not in_worker and route == "plugin":
        out.append(
            f"  plugin_loaded: {status.get('plugin_loaded')}: whether vLLM's plugin loader ran the vllm_compat entry "
            "point in THIS process; on the plugin route it runs in the workers, so False here is expected"
        )
    else:
        out.append(
            f"  plugin_loaded: {status.get('plugin_loaded')}: whether vLLM's plugin loader ran the vllm_compat entry "
            "point in this process"
        )
    out.append(
        f"  guarded: {status.get('guarded')}: "
        + (
            "speculators' generator constructor checks for drift no adapter covers before any model loads"
            if status.get("guarded")
            else "the generator's constructor is not wrapped (yet): speculators' generator module is not imported"
        )
    )
    out.append(
        f"  strict: {status.get('strict')}: "
        + (
            "uncovered drift stops the run already when speculators' generator is imported (or at install)"
            if status.get("strict")
            else "uncovered drift raises UnhandledDrift when the generator is constructed, before the model loads"
        )
    )
    if pass_through:
        names = ", ".join(f"{k} ({len(v)} wrapper(s))" for k, v in pass_through.items())
        out.append(
            f"  pass_through: {names}: reverted by uninstall(), but their wrappers stay in place, switched off "
            "(calls pass straight through), because wrappers applied after ours sit on top of them"
        )
    else:
        out.append("  pass_through: none (adapters reverted by uninstall() under someone else's wrapper)")
    out.append(f"  hooks: {len(status.get('hooks') or [])} modules watched for import")
    out.append("  the whole mapping: dict(vllm_compat.status()); as JSON: `vllm-compat status --json`")
    return "\n".join(_wrap(line) for line in out)


def _wrap(line: str) -> str:
    """A long line folded at ``WIDTH``, its continuation indented under its own text."""
    if len(line) <= WIDTH:
        return line
    import textwrap

    indent = " " * (len(line) - len(line.lstrip()))
    return textwrap.fill(line.strip(), WIDTH, initial_indent=indent, subsequent_indent=indent + "    ")
