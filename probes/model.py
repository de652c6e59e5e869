"""vllm.model_executor.models: what the worker extension's patched forward calls on the model, per model family.

speculators' worker extension replaces the forward of the module that holds the decoder layers (the "base model")
with its own loop: ``layer(hidden_states=, positions=, residual=)`` over ``self.layers[start_layer:end_layer]``,
``hidden + residual`` after each requested layer, ``self.norm(hidden, residual)`` at the end, and the token
embeddings from ``get_input_embeddings`` (0.3.0) or ``embed_input_ids`` (0.4.0.1). 0.3.0 finds the base model as
``model.model`` after ``supports_eagle3(model)``; 0.4.0.1 as ``model.get_language_model().model`` when the model
has ``get_language_model`` (multimodal wrappers), else ``model.model``.

Each family of :data:`FAMILIES` gets the same facts, one probe each (made by :func:`family_probes`). The Llama
family keeps the ids it had before the table (``model.<fact>``); the others are ``model.<family>.<fact>``. A plan
judges a family's facts when that family is asked for (the model's ``architectures``; Llama by default).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass

from vllm_compat.probes._kit import LINES, V030, V040, check_call, evidence, parse_source

from vllm_compat.apiview import ApiView, Location
from vllm_compat.findings import BASELINE, Observation, Probe, probe

__all__ = ["FAMILIES", "Family", "families_for", "family_probes"]

MODELS = "vllm.model_executor.models"
MISSING = "missing"


@dataclass(frozen=True)
class Family:
    """One model family: its classes in vLLM and the path from the top-level model to the decoder layers.

    ``hops`` are ``(class, attribute, class it builds there)`` from the top-level class down to the base model
    (the module holding ``layers``); class names are relative to ``vllm.model_executor.models``.
    """

    name: str
    title: str
    architectures: tuple[str, ...]  # the HF config ``architectures`` entries this family serves
    hops: tuple[tuple[str, str, str], ...]
    layer: str  # the decoder layer class

    @property
    def top(self) -> str:
        return f"{MODELS}.{self.hops[0][0]}"

    @property
    def base(self) -> str:
        return f"{MODELS}.{self.hops[-1][2]}"

    @property
    def decoder_layer(self) -> str:
        return f"{MODELS}.{self.layer}"

    @property
    def prefix(self) -> str:
        return "model" if self.name == "llama" else f"model.{self.name}"

    def short(self, dotted: str) -> str:
        return dotted.rsplit(".", 1)[-1]


FAMILIES: tuple[Family, ...] = (
    Family(
        "llama",
        "Llama",
        ("LlamaForCausalLM",),
        (("llama.LlamaForCausalLM", "model", "llama.LlamaModel"),),
        "llama.LlamaDecoderLayer",
    ),
    Family(
        "qwen3",
        "Qwen3",
        ("Qwen3ForCausalLM",),
        (("qwen3.Qwen3ForCausalLM", "model", "qwen3.Qwen3Model"),),
        "qwen3.Qwen3DecoderLayer",
    ),
    Family(  # MLA attention and a routed MoE; Kimi-K2 ships as DeepseekV3ForCausalLM
        "deepseek_v3",
        "DeepSeek-V3 (MLA + MoE)",
        ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"),
        (("deepseek_v2.DeepseekV3ForCausalLM", "model", "deepseek_v2.DeepseekV2Model"),),
        "deepseek_v2.DeepseekV2DecoderLayer",
    ),
    Family(  # a multimodal wrapper around a Qwen3 language model (with deepstack visual inputs)
        "qwen3_vl",
        "Qwen3-VL",
        ("Qwen3VLForConditionalGeneration",),
        (
            ("qwen3_vl.Qwen3VLForConditionalGeneration", "language_model", "qwen3_vl.Qwen3LLMForCausalLM"),
            ("qwen3_vl.Qwen3LLMForCausalLM", "model", "qwen3_vl.Qwen3LLMModel"),
        ),
        "qwen3.Qwen3DecoderLayer",
    ),
    Family(  # a multimodal wrapper around a DeepSeek-V3-style language model
        "kimi_k25",
        "Kimi-K2.5",
        ("KimiK25ForConditionalGeneration",),
        (
            ("kimi_k25.KimiK25ForConditionalGeneration", "language_model", "deepseek_v2.DeepseekV2ForCausalLM"),
            ("deepseek_v2.DeepseekV2ForCausalLM", "model", "deepseek_v2.DeepseekV2Model"),
        ),
        "deepseek_v2.DeepseekV2DecoderLayer",
    ),
    Family(  # alternating sliding-window and full attention, MoE
        "gpt_oss",
        "gpt-oss",
        ("GptOssForCausalLM",),
        (("gpt_oss.GptOssForCausalLM", "model", "gpt_oss.GptOssModel"),),
        "gpt_oss.TransformerBlock",
    ),
)
BY_NAME = {f.name: f for f in FAMILIES}


def families_for(architectures: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The families serving a model's ``architectures`` (from its config.json); empty if none does."""
    return tuple(dict.fromkeys(f.name for arch in architectures for f in FAMILIES if arch in f.architectures))


# -- what the base model's forward must look like -------------------------------------------------------------

FORWARD_PARAMS = ["input_ids", "positions", "intermediate_tensors", "inputs_embeds"]
LAYER_KWARGS = ["hidden_states", "positions", "residual"]
# Extra base-forward parameters 0.4.0.1's ``**_kwargs`` takes and drops, knowingly: deepstack visual embeddings
# (Qwen3-VL), which are zero for the text-only prompts the generator sends.
V040_DROPS = {"extra=deepstack_input_embeds"}
# Calls a base model's layer loop may make besides the layer itself: vLLM's own EAGLE-3 capture, which speculators'
# loop replaces with its own.
_LOOP_BOOKKEEPING = {"_maybe_add_hidden_state", "append", "enumerate", "islice", "range", "len"}
# The all-gather of sequence-parallel MoE (DeepSeek): on only with expert parallelism and data_parallel_size > 1.
_SEQUENCE_PARALLEL = {"tensor_model_parallel_all_gather"}


def _absent(fam: Family, view: ApiView) -> Observation | None:
    """A ``missing`` observation if this vLLM does not have the family's top-level class (or cannot import it)."""
    if view.locate(fam.top) is not None:
        return None
    module = fam.top.rsplit(".", 1)[0]
    import_error = getattr(view, "import_error", lambda _m: None)  # LiveView: why a module did not import
    if not view.has_module(MODELS):
        return Observation.unknown(f"{MODELS} is not readable ({import_error(MODELS) or 'absent'})")
    if import_error(module):
        return Observation.unknown(f"{module} does not import here ({import_error(module)})")
    if view.has_module(module):  # the file is there: unreadable, or the class renamed
        return Observation.unknown(f"{module} has no readable {fam.short(fam.top)}")
    return Observation(MISSING, f"{fam.short(fam.top)} is not in this vLLM: it cannot load {fam.title}")


def _function(view: ApiView, dotted: str) -> tuple[ast.FunctionDef, Location | None] | None:
    parsed = parse_source(view, dotted)
    if parsed is None:
        return None
    tree, loc = parsed
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)), None)
    return (fn, loc) if fn is not None else None  # type: ignore[return-value]


def _base_forward(fam: Family, view: ApiView) -> tuple[ast.FunctionDef, Location | None] | Observation:
    """The decoder stack's ``forward`` as ast, or the observation saying why not (family absent, unreadable)."""
    absent = _absent(fam, view)
    if absent:
        return absent
    found = _function(view, f"{fam.base}.forward")
    if found is None:
        return Observation.unknown(f"{fam.short(fam.base)}.forward is not readable")
    return found


def _own_nodes(fn: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a function body, not descending into nested functions, lambdas or classes."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            stack.extend(ast.iter_child_nodes(node))


def _is_self_attr(node: ast.AST, attr: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == attr
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _owner_source(view: ApiView, dotted_method: str) -> tuple[str, Location] | None:
    """The source of the class that defines ``Class.method`` (found through the class's bases)."""
    loc = view.locate(dotted_method)
    if loc is None or "." not in loc.qualname:
        return None
    owner = f"{loc.module}.{loc.qualname.rsplit('.', 1)[0]}"
    src = view.source(owner)
    return (src.text, loc) if src is not None else None


def _builds(view: ApiView, owner: str, attr: str, built: str) -> tuple[bool, str]:
    """Whether ``owner``'s constructor sets ``self.<attr>`` to a ``built`` (named in the defining class's source)."""
    found = _owner_source(view, f"{MODELS}.{owner}.__init__")
    if found is None:
        return False, f"{owner}.__init__ is not readable"
    text, loc = found
    name = built.rsplit(".", 1)[-1]
    if not re.search(rf"self\.{attr}\s*(?::[^=]+)?=", text):
        return False, evidence(loc, f"no self.{attr} = ...")
    if not re.search(rf"\b{re.escape(name)}\b", text):
        return False, evidence(loc, f"self.{attr} is not built from {name}")
    return True, evidence(loc, f"self.{attr} = {name}(...)")


def _bases(view: ApiView, dotted: str) -> list[str]:
    """Dotted names of the classes ``dotted`` names as bases, where the view can place them."""
    src = view.source(dotted)
    loc = view.locate(dotted)
    if src is None or loc is None:
        return []
    try:
        tree = ast.parse(src.text)
    except SyntaxError:
        return []
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef)), None)
    found = []
    for base in node.bases if node is not None else []:
        name = ast.unparse(base.value if isinstance(base, ast.Subscript) else base)
        candidate = f"{loc.module}.{name}"
        where = view.locate(candidate)
        if where is not None and where.kind == "class":
            found.append(where.dotted)
    return found


def _init_texts(view: ApiView, dotted: str, depth: int = 0) -> list[str]:
    """Constructor sources of ``dotted`` and, where it calls ``super().__init__``, of its bases."""
    if depth > 4:
        return []
    src = view.source(f"{dotted}.__init__")
    if src is None:
        return []
    texts = [src.text]
    if "super().__init__" in src.text:
        loc = view.locate(f"{dotted}.__init__")
        owner = f"{loc.module}.{loc.qualname.rsplit('.', 1)[0]}" if loc and "." in loc.qualname else dotted
        for base in _bases(view, owner):
            texts += _init_texts(view, base, depth + 1)
    return texts


# -- the facts ------------------------------------------------------------------------------------------------


def _layer_path(fam: Family, view: ApiView) -> Observation:
    absent = _absent(fam, view)
    if absent:
        return absent
    members = view.members(fam.top)
    if members is None:
        return Observation.unknown(f"{fam.short(fam.top)} is not readable")
    notes = []
    base = fam.short(fam.base)
    for i, (owner, attr, built) in enumerate(fam.hops):
        ok, note = _builds(view, owner, attr, built)
        notes.append(note)
        if ok:
            continue
        if i == 0 and len(fam.hops) > 1 and "get_language_model" in members:
            direct, direct_note = _builds(view, owner, attr, fam.hops[-1][2])
            if direct:  # the wrapper's language model is the base model itself: no .model under it
                return Observation(
                    "language_model_is_base",
                    f"{fam.short(fam.top)}.get_language_model() is the {base} holding the layers (no .model)",
                    (direct_note,),
                )
        return Observation("changed", f"the way to the decoder layers moved: {note}", tuple(notes))
    if "get_language_model" in members:
        return Observation(
            "language_model",
            f"{fam.short(fam.top)} is a wrapper: get_language_model().model is the {base} holding the layers",
            tuple(notes),
        )
    if fam.hops[0][1] != "model" or len(fam.hops) != 1:
        return Observation("changed", f"{fam.short(fam.top)} has no get_language_model and no .model", tuple(notes))
    return Observation("model", f"{fam.short(fam.top)}.model is the {base} holding the layers", tuple(notes))


def _embedding_method(fam: Family, view: ApiView) -> Observation:
    absent = _absent(fam, view)
    if absent:
        return absent
    base = fam.short(fam.base)
    members = view.members(fam.base)
    if members is None:
        return Observation.unknown(f"{base} is not readable")
    has_old, has_new = "get_input_embeddings" in members, "embed_input_ids" in members
    where = evidence(view.locate(fam.base))
    if has_old and has_new:
        return Observation("both", f"{base} has get_input_embeddings and embed_input_ids", (where,))
    if has_new:
        return Observation(
            "embed_input_ids",
            f"{base}.get_input_embeddings was renamed embed_input_ids",
            (evidence(view.locate(f"{fam.base}.embed_input_ids")),),
        )
    if has_old:
        return Observation("get_input_embeddings", f"{base} has only get_input_embeddings", (where,))
    return Observation(MISSING, f"{base} has neither embedding method", (where,))


def _forward_params(fam: Family, view: ApiView) -> Observation:
    absent = _absent(fam, view)
    if absent:
        return absent
    dotted = f"{fam.base}.forward"
    params = view.parameters(dotted)
    if params is None:
        return Observation.unknown(f"{fam.short(fam.base)}.forward is not readable")
    names = [p.name for p in params if p.kind not in {"var_positional", "var_keyword"}]
    where = evidence(view.locate(dotted))
    shown = f"forward({', '.join(p.name + ('' if p.required else '=…') for p in params)})"
    extra_required = [p.name for p in params if p.required and p.name not in FORWARD_PARAMS]
    if names[:4] != FORWARD_PARAMS or extra_required:
        return Observation("changed", shown, (where,))
    if names[4:]:
        extra = ",".join(names[4:])
        return Observation(f"extra={extra}", f"{shown}: callers may pass {', '.join(names[4:])}", (where,))
    return Observation(BASELINE, shown, (where,))


def _decoder_layer_call(fam: Family, view: ApiView) -> Observation:
    absent = _absent(fam, view)
    if absent:
        return absent
    dotted = f"{fam.decoder_layer}.forward"
    params = view.parameters(dotted)
    found = _function(view, dotted)
    layer = fam.short(fam.decoder_layer)
    if params is None or found is None:
        return Observation.unknown(f"{layer}.forward is not readable")
    fn, loc = found
    where = evidence(loc)
    shown = f"forward({', '.join(p.name + ('' if p.required else '=…') for p in params)})"
    rejected, missing = check_call(params, LAYER_KWARGS, 0)
    parts = ([f"rejects={','.join(rejected)}"] if rejected else []) + (
        [f"requires={','.join(missing)}"] if missing else []
    )
    returns = [n for n in _own_nodes(fn) if isinstance(n, ast.Return)]
    odd = [
        ast.unparse(r.value) if r.value is not None else "None"
        for r in returns
        if not (
            isinstance(r.value, ast.Tuple)
            and len(r.value.elts) == 2
            and isinstance(r.value.elts[1], ast.Name)
            and r.value.elts[1].id == "residual"
        )
    ]
    if odd or not returns:
        parts.append("returns=" + (odd[0] if odd else "nothing"))
    if parts:
        return Observation(";".join(parts), f"{layer}.{shown}", (where,))
    shape = ast.unparse(returns[0].value)  # type: ignore[arg-type]
    return Observation(BASELINE, f"{layer}.{shown} returns {shape}", (where,))


def _layer_loop(fn: ast.FunctionDef) -> tuple[ast.For, ast.Call, ast.AST] | None:
    """The base forward's loop over ``self.layers``, the layer call in it and the statement that makes it."""
    for node in _own_nodes(fn):
        if not isinstance(node, ast.For):
            continue
        layer_vars = {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
        for stmt in ast.walk(node):
            if isinstance(stmt, ast.Assign) and any(_is_self_attr(s, "layers") for s in ast.walk(stmt.value)):
                layer_vars |= {n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        if not any(_is_self_attr(n, "layers") for n in ast.walk(node)):
            continue
        for stmt in ast.walk(node):
            if (
                isinstance(stmt, ast.Assign)
                and isinstance(stmt.value, ast.Call)
                and isinstance(stmt.value.func, ast.Name)
                and stmt.value.func.id in layer_vars
            ):
                return node, stmt.value, stmt
    return None


def _layer_inputs(fam: Family, view: ApiView) -> Observation:
    found = _base_forward(fam, view)
    if isinstance(found, Observation):
        return found
    fn, loc = found
    where = evidence(loc)
    loop = _layer_loop(fn)
    if loop is None:
        return Observation("changed", f"{fam.short(fam.base)}.forward has no loop calling self.layers", (where,))
    node, call, stmt = loop
    targets = stmt.targets[0] if isinstance(stmt, ast.Assign) else None
    hidden = targets.elts[0].id if isinstance(targets, ast.Tuple) and isinstance(targets.elts[0], ast.Name) else ""
    own_kwargs = fn.args.kwarg.arg if fn.args.kwarg else None
    known = {"positions", "residual", "hidden_states", hidden}
    extra = [ast.unparse(a) for a in call.args if not (isinstance(a, ast.Name) and a.id in known)]
    passthrough = []
    for kw in call.keywords:
        if kw.arg is None and isinstance(kw.value, ast.Name) and kw.value.id == own_kwargs:
            passthrough.append(f"**{own_kwargs}")  # the forward's own **kwargs: only what its caller passes
        elif kw.arg not in {"positions", "residual", "hidden_states"}:
            extra.append(kw.arg or f"**{ast.unparse(kw.value)}")
    steps: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and sub is not call:
            func = sub.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            steps.add(name)
    steps -= _LOOP_BOOKKEEPING | {"cat", "split", "clone", "contiguous"}  # tensor bookkeeping
    parts = [f"extra={','.join(extra)}"] if extra else []
    if steps & _SEQUENCE_PARALLEL:
        parts.append("sequence_parallel_gather")
    if steps - _SEQUENCE_PARALLEL:
        parts.append(f"steps={','.join(sorted(steps - _SEQUENCE_PARALLEL))}")
    shown = f"{ast.unparse(stmt)}" + (f" (and {', '.join(sorted(steps))} in the loop)" if steps else "")
    line = f"{loc.file}:{(loc.line or 1) + stmt.lineno - 1}" if loc and loc.file else ""  # the layer call
    where = f"{loc.dotted} ({line})" if loc and line else where
    if passthrough:
        shown += f"; {', '.join(passthrough)} passed through from the forward's caller"
    return Observation(";".join(parts) or BASELINE, shown, (where,))


def _layer_attributes(fam: Family, view: ApiView) -> Observation:
    absent = _absent(fam, view)
    if absent:
        return absent
    texts = _init_texts(view, fam.base)
    if not texts:
        return Observation.unknown(f"{fam.short(fam.base)}.__init__ is not readable")
    text = "\n".join(texts)
    missing = [a for a in ("self.layers", "self.start_layer", "self.end_layer", "self.norm") if a not in text]
    where = evidence(view.locate(f"{fam.base}.__init__"))
    if missing:
        return Observation("changed", "not set up: " + ", ".join(missing), (where,))
    return Observation(BASELINE, f"{fam.short(fam.base)} has layers, start_layer, end_layer and norm", (where,))


def _final_norm(fam: Family, view: ApiView) -> Observation:
    found = _base_forward(fam, view)
    if isinstance(found, Observation):
        return found
    fn, loc = found
    calls = [
        n
        for n in _own_nodes(fn)
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and _is_self_attr(n.value.func, "norm")
    ]
    where = evidence(loc)
    if not calls:
        return Observation("changed", f"{fam.short(fam.base)}.forward does not call self.norm", (where,))
    stmt = calls[-1]
    call = stmt.value  # type: ignore[union-attr]
    fused = (
        len(call.args) == 2
        and not call.keywords
        and isinstance(call.args[1], ast.Name)
        and call.args[1].id == "residual"
        and isinstance(stmt.targets[0], ast.Tuple)
        and len(stmt.targets[0].elts) == 2
    )
    if loc and loc.file and loc.line:
        where = f"{loc.dotted} ({loc.file}:{loc.line + stmt.lineno - 1})"
    if not fused:
        return Observation("changed", ast.unparse(stmt), (where,))
    return Observation(BASELINE, ast.unparse(stmt), (where,))


def _eagle3_interface(fam: Family, view: ApiView) -> Observation:
    absent = _absent(fam, view)
    if absent:
        return absent
    top = fam.short(fam.top)
    members = view.members(fam.top)
    if members is None:
        return Observation.unknown(f"{top} is not readable")
    where = evidence(view.locate(fam.top))
    if "supports_eagle3" in members:
        return Observation(BASELINE, f"{top} is a SupportsEagle3 (declared or inherited)", (where,))
    return Observation("undeclared", f"{top} does not declare SupportsEagle3", (where,))


def family_probes(fam: Family) -> dict[str, Probe]:
    """Register the model-side facts of one family; returns them by fact name."""
    top, base, layer = fam.short(fam.top), fam.short(fam.base), fam.short(fam.decoder_layer)
    made: dict[str, Probe] = {}

    def register(fact: str, symbol: str, summary: str, expected, accepts, observe) -> None:
        def bound(view: ApiView) -> Observation:
            return observe(fam, view)

        bound.__module__ = __name__
        bound.__qualname__ = f"{fam.name}.{fact}"
        made[fact] = probe(
            f"{fam.prefix}.{fact}",
            symbol=symbol,
            summary=f"{fam.title}: {summary}",
            expected=expected,
            accepts=accepts,
            family=fam.name,
        )(bound)

    register(
        "layer_path",
        fam.top,
        f"where the decoder layers are ({top} -> {base}.layers)",
        {
            V030: f"{top}.model is the base model holding the layers (0.3.0 uses model.model)",
            V040: f"{top}.get_language_model().model for a multimodal wrapper, else {top}.model",
        },
        {V030: {"model"}, V040: {"model", "language_model"}},
        _layer_path,
    )
    register(
        "embedding_method",
        f"{fam.base}.embed_input_ids",
        "the base model's token-embedding method",
        {V030: f"{base}.get_input_embeddings(input_ids)", V040: f"{base}.embed_input_ids(input_ids)"},
        {V030: {"get_input_embeddings", "both"}, V040: {"embed_input_ids", "both"}},
        _embedding_method,
    )
    register(
        "forward_params",
        f"{fam.base}.forward",
        "the base model's forward takes (input_ids, positions, intermediate_tensors, inputs_embeds)",
        {
            V030: "forward(input_ids, positions, intermediate_tensors=None, inputs_embeds=None), nothing else",
            V040: "forward(input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **_kwargs): "
            "extra keyword arguments are dropped (deepstack_input_embeds: zero for text-only prompts)",
        },
        {V030: {BASELINE}, V040: {BASELINE, *V040_DROPS}},
        _forward_params,
    )
    register(
        "decoder_layer_call",
        f"{fam.decoder_layer}.forward",
        "layer(hidden_states=, positions=, residual=) returns (hidden_states, residual)",
        dict.fromkeys(LINES, f"{layer}(hidden_states=, positions=, residual=) -> (hidden_states, residual)"),
        None,
        _decoder_layer_call,
    )
    register(
        "layer_inputs",
        f"{fam.base}.forward",
        "the base model passes each layer only (positions, hidden_states, residual)",
        dict.fromkeys(LINES, f"{base}.forward calls layer(positions, hidden_states, residual) and nothing else"),
        None,
        _layer_inputs,
    )
    register(
        "layer_attributes",
        f"{fam.base}.layers",
        "the base model keeps layers, start_layer, end_layer and norm",
        dict.fromkeys(LINES, "self.layers / start_layer / end_layer / norm"),
        None,
        _layer_attributes,
    )
    register(
        "final_norm",
        f"{fam.base}.norm",
        "the final norm fuses the residual: norm(hidden, residual) -> (out, residual)",
        dict.fromkeys(LINES, "hidden_states, _ = self.norm(hidden_states, residual)"),
        None,
        _final_norm,
    )
    register(
        "eagle3_interface",
        fam.top,
        f"{top} declares SupportsEagle3 (0.3.0 refuses models that do not)",
        {V030: f"supports_eagle3({top}) is True"},
        None,
        _eagle3_interface,
    )
    return made


PROBES: dict[str, dict[str, Probe]] = {fam.name: family_probes(fam) for fam in FAMILIES}
